"""The Responses API's input items as clients send them (``input`` as text, or a list of messages, function calls
and function call outputs, including output items of an earlier response sent back), their stored form (the
shape ``GET /v1/responses/{id}/input_items`` lists and a response's ``output`` holds), and the chat messages a
conversation of such items becomes for the pipeline (function calls as an assistant message's ``tool_calls``,
their outputs as ``tool`` messages).

Content other than text (images, files, audio) and item types other than those three (reasoning, built-in tool
calls, item references) are refused by name with a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from sluicegate.api.errors import ApiError

_CALL_ID = Field(min_length=1, max_length=128)
_ITEM_ID = Field(None, min_length=1, max_length=128)
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def unsupported(message: str) -> PydanticCustomError:
    """An error ``sluicegate.api.errors.invalid`` answers with 400 ``unsupported_parameter``."""
    return PydanticCustomError("unsupported", message)


class _Body(BaseModel):
    # Unknown fields are reported, never silently dropped.
    model_config = ConfigDict(extra="forbid")


class ContentPartIn(BaseModel):
    """One part of a message's content: ``input_text``, or ``output_text`` (an assistant message sent back)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "properties": {
                "type": {"enum": ["input_text", "output_text"]},
                "text": {"type": "string"},
                "annotations": {"type": "array", "maxItems": 0},
                "logprobs": {"type": "array"},
            },
            "required": ["type", "text"],
            "additionalProperties": False,
        },
    )

    @model_validator(mode="after")
    def _text_only(self) -> ContentPartIn:
        if self.type not in ("input_text", "output_text"):
            raise unsupported(f"content parts of type {self.type!r} are not supported; only 'input_text'")
        if self.text is None or self.model_extra:
            raise PydanticCustomError("invalid_text_part", "a text part is {'type': 'input_text', 'text': '...'}")
        if self.annotations:
            raise unsupported("annotations are not supported")
        return self


class MessageIn(_Body):
    """A message: ``{"role", "content"}`` (content as text or text parts), ``type: "message"`` optional."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPartIn], Field(max_length=1024)]
    id: str | None = _ITEM_ID
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallIn(_Body):
    """A function call the model made earlier (an output item of a previous response, sent back)."""

    type: Literal["function_call"]
    call_id: str = _CALL_ID
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    arguments: str
    id: str | None = _ITEM_ID
    status: ItemStatus | None = None


class FunctionCallOutputIn(_Body):
    """What a function call returned, answering it by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = _CALL_ID
    output: str | Annotated[list[ContentPartIn], Field(max_length=1024)]
    id: str | None = _ITEM_ID
    status: ItemStatus | None = None


class UnsupportedItem(BaseModel):
    """Any other item type: refused by name."""

    type: str
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedItem:
        raise unsupported(
            f"input items of type {self.type!r} are not supported; only 'message', 'function_call' and "
            "'function_call_output'"
        )


_SUPPORTED = {"message": "message-item", "function_call": "function-call", "function_call_output": "call-output"}


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return _SUPPORTED.get(kind, "other-item") if isinstance(kind, str) else "other-item"


# Tags carry a hyphen so error paths leave them out (sluicegate.validation_errors reads them as union branches).
InputItem = Annotated[
    Annotated[MessageIn, Tag("message-item")]
    | Annotated[FunctionCallIn, Tag("function-call")]
    | Annotated[FunctionCallOutputIn, Tag("call-output")]
    | Annotated[UnsupportedItem, Tag("other-item"), SkipJsonSchema()],
    Discriminator(_item_tag),
]


def _text(content: str | list[ContentPartIn]) -> str:
    return content if isinstance(content, str) else "".join(part.text or "" for part in content)


def stored_items(given: str | list[Any]) -> list[dict[str, Any]]:
    """The stored form of a body's ``input`` (ids still missing where the client gave none)."""
    if isinstance(given, str):
        return [_message("user", given, None)]
    items: list[dict[str, Any]] = []
    for item in given:
        if isinstance(item, MessageIn):
            items.append(_message(item.role, _text(item.content), item.id))
        elif isinstance(item, FunctionCallIn):
            items.append(function_call_item(item.id, item.call_id, item.name, item.arguments))
        else:
            assert isinstance(item, FunctionCallOutputIn)
            items.append(
                {
                    "id": item.id,
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": _text(item.output),
                    "status": "completed",
                }
            )
    return items


def _message(role: str, text: str, item_id: str | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "input_text", "text": text}
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": role, "status": "completed", "content": [part]}


def function_call_item(item_id: str | None, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``function_call`` item (also the output item a response makes)."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def with_ids(items: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """The items with an id each: the client's, else one derived from the request id and the item's place."""
    return [
        item if item.get("id") else item | {"id": f"{_ID_PREFIX[item['type']]}_{request_id}_in{n}"}
        for n, item in enumerate(items)
    ]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items, after a system message of ``instructions``: consecutive
    function calls join one assistant message's ``tool_calls`` (after that message's text, if it has some), and
    each function call output is a ``tool`` message. 400 for an output that answers no call of the conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            calls.add(item["call_id"])
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise ApiError(
                    400,
                    f"No function call found for the function_call_output with call_id '{item['call_id']}'.",
                    code="invalid_value",
                    param="input",
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages
