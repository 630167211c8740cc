"""Stream events a worker appends to ``llm:stream:<request_id>`` and the result service relays.

Each event carries the request id and a per-request ``seq`` starting at 0. The Redis entry id is
derived from ``seq`` (:func:`stream_entry_id`), so a replayed append is refused by Redis itself.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Annotated, Literal

from pydantic import Field, SerializerFunctionWrapHandler, TypeAdapter, model_serializer

from .common import Message, RequestId
from .generation import TokenLogprob

FinishReason = Literal["stop", "length", "abort", "error"]

#: Field name holding the JSON event in every stream entry.
STREAM_FIELD = "event"


class Usage(Message):
    """Token accounting, OpenAI-shaped, plus how much of the prompt the prefix cache served."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    cached_tokens: int = Field(0, ge=0)
    cached: bool = Field(False, description="The reply came from ingress's response cache, not a worker.")

    @model_serializer(mode="wrap")
    def _omit_uncached(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Left out unless set, so a worker's usage reads exactly as it did before the response cache existed.
        data = handler(self)
        if not data.get("cached"):
            data.pop("cached", None)
        return data


class _Event(Message):
    request_id: RequestId
    seq: int = Field(ge=0)


class TokenEvent(_Event):
    """New text (may be empty while a multi-byte character is incomplete) and its token ids.

    With ``n`` > 1 each event names its choice (``index``) and a choice's last event carries its
    ``finish_reason``; the request's ``done`` follows once every choice ended. ``logprobs`` (aligned with
    ``token_ids``) appear only when asked for. Fields at their defaults are left out of the JSON, so a
    one-choice stream without logprobs reads exactly as it did before they existed.
    """

    type: Literal["token"] = "token"
    text: str
    token_ids: list[Annotated[int, Field(ge=0)]]
    index: int = Field(0, ge=0)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = Field(None, description="Set on a choice's last event when n > 1.")

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data = handler(self)
        if data.get("index") == 0:
            data.pop("index")
        for optional in ("logprobs", "finish_reason"):
            if data.get(optional) is None:
                data.pop(optional, None)
        return data


class DoneEvent(_Event):
    """The last event of a finished request; an embedding request's carries its vector (``embedding``, base64 of
    little-endian float32, as OpenAI's ``encoding_format: base64``; left out of the JSON otherwise)."""

    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    embedding: str | None = Field(None, description="An embedding request's vector: base64 of little-endian float32.")

    @model_serializer(mode="wrap")
    def _omit_no_embedding(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data = handler(self)
        if data.get("embedding") is None:
            data.pop("embedding", None)
        return data


def encode_embedding(vector: list[float]) -> str:
    """A vector as base64 of little-endian float32 (OpenAI's ``encoding_format: base64``)."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def decode_embedding(encoded: str) -> list[float]:
    """The vector of :func:`encode_embedding` (float32 values, as floats)."""
    values = array("f")
    values.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


class ErrorEvent(_Event):
    """The request failed; ``code`` is machine-readable (e.g. ``deadline_exceeded``)."""

    type: Literal["error"] = "error"
    code: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")
    message: str


class RestartEvent(_Event):
    """Generation starts over: clients discard every event with ``seq > discard_after_seq``."""

    type: Literal["restart"] = "restart"
    discard_after_seq: int = Field(ge=-1)


StreamEvent = Annotated[TokenEvent | DoneEvent | ErrorEvent | RestartEvent, Field(discriminator="type")]
stream_event_adapter: TypeAdapter[StreamEvent] = TypeAdapter(StreamEvent)

TERMINAL_TYPES = frozenset({"done", "error"})


def stream_entry_id(seq: int) -> str:
    """The explicit Redis stream entry id for event ``seq`` (ids must start above ``0-0``)."""
    if seq < 0:
        raise ValueError("seq must be >= 0")
    return f"0-{seq + 1}"


def seq_from_entry_id(entry_id: str | bytes) -> int:
    """Inverse of :func:`stream_entry_id`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, counter = text.partition("-")
    if ms != "0" or not counter.isdigit() or int(counter) < 1:
        raise ValueError(f"not a Sluicegate stream entry id: {text!r}")
    return int(counter) - 1


def parse_stream_event(raw: str | bytes) -> StreamEvent:
    """Validate one JSON event."""
    return stream_event_adapter.validate_json(raw)
