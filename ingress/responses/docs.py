"""The Responses API's objects in the OpenAPI document: the ``response`` object, its event stream, the input
item list and the deletion answer. They document what :mod:`.objects` and :mod:`.events` build; the schemathesis
test checks real answers against them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .objects import Status


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputTokensDetails(_Doc):
    cached_tokens: int = Field(ge=0)


class OutputTokensDetails(_Doc):
    reasoning_tokens: int = Field(ge=0)


class ResponseUsage(_Doc):
    input_tokens: int = Field(ge=0)
    input_tokens_details: InputTokensDetails
    output_tokens: int = Field(ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(ge=0)


class ResponseError(_Doc):
    code: str
    message: str


class ResponseObject(_Doc):
    """A ``response`` (with ``stream``, a ``text/event-stream`` of its events, each with its ``sequence_number``)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Status
    background: bool
    model: str
    output: list[dict[str, Any]] = Field(description="Output items: messages and function calls.")
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    metadata: dict[str, str]
    previous_response_id: str | None
    store: bool


class InputItemList(_Doc):
    """A page of a response's input items."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(_Doc):
    """A deleted response."""

    id: str
    object: Literal["response"]
    deleted: Literal[True]


# One server-sent event: named by its type (``response.created``, ``response.output_text.delta``...), its data
# the event object as JSON.
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "description": "The event's type, e.g. response.output_text.delta."},
        "data": {"type": "string", "description": "The event as JSON, with its type and sequence_number."},
    },
    "required": ["data"],
}


def response_ok() -> dict[int | str, dict[str, Any]]:
    """The 200 entry of an operation answering a response object, or its event stream."""
    return {
        200: {
            "model": ResponseObject,
            "description": (ResponseObject.__doc__ or "").strip(),
            "headers": {"x-request-id": {"description": "The request id.", "schema": {"type": "string"}}},
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        }
    }
