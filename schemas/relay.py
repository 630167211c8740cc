"""The multiplexed stream socket's own messages (``/v1/streams`` on the result service): what a client sends to
follow, stop following or cancel several requests over one WebSocket, and the two notices the relay answers with.

The streams' events themselves are :data:`schemas.events.StreamEvent` as every relay sends them; each carries its
``request_id``, which is how a client tells the streams on one socket apart.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from .common import Message, RequestId


class Subscribe(Message):
    """Follow one request's stream on this socket, from the start or after ``last_id``."""

    type: Literal["subscribe"] = "subscribe"
    request_id: RequestId
    token: str = Field(min_length=1, max_length=1024, description="The stream_token the submit response gave.")
    last_id: str | None = Field(
        None, max_length=64, description="The 'id' of the last event received: the stream resumes after it."
    )


class Unsubscribe(Message):
    """Stop following a request on this socket (the request goes on; subscribe again with ``last_id``)."""

    type: Literal["unsubscribe"] = "unsubscribe"
    request_id: RequestId


class Cancel(Message):
    """Cancel a request this socket follows: its worker stops generating and the stream ends with ``done``
    (finish_reason ``abort``)."""

    type: Literal["cancel"] = "cancel"
    request_id: RequestId


ClientMessage = Annotated[Subscribe | Unsubscribe | Cancel, Field(discriminator="type")]
CLIENT_MESSAGE: TypeAdapter[Subscribe | Unsubscribe | Cancel] = TypeAdapter(ClientMessage)


class StreamClosed(Message):
    """A subscription ended other than by its stream's ``done`` or ``error`` event. ``code`` is the close code the
    single-stream socket (``/v1/streams/<request_id>``) would have closed with: 1000 the client has everything
    already (or unsubscribed), 1008 refused (token, ``last_id``, limits), 1013 the stream store failed (subscribe
    again with ``last_id``), 4404 the request ended and its stream expired."""

    type: Literal["closed"] = "closed"
    request_id: RequestId
    code: int
    reason: str


class Invalid(Message):
    """A client message the relay could not act on, and why; the socket and its other streams go on."""

    type: Literal["invalid"] = "invalid"
    reason: str
    request_id: str | None = None


Notice = Annotated[StreamClosed | Invalid, Field(discriminator="type")]
NOTICE: TypeAdapter[StreamClosed | Invalid] = TypeAdapter(Notice)
