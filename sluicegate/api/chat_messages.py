"""Chat messages as clients send them (text parts only; assistant ``tool_calls`` and ``tool`` results included),
and their conversion to the pipeline's :class:`schemas.ChatMessage`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas import ChatMessage, TextPart, ToolCall


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def _only(*values: Any, description: str) -> WithJsonSchema:
    return WithJsonSchema({"enum": list(values), "description": description})


class _Body(BaseModel):
    # Unknown fields are reported, never silently dropped.
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Body):
    """One part of a message's content array; only text is supported."""

    type: str
    text: str | None = None
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "required": ["type", "text"],
            "additionalProperties": False,
        },
    )

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise _unsupported(f"content parts of type {self.type!r} are not supported; only 'text'")
        if self.text is None or self.model_extra:
            raise PydanticCustomError("invalid_text_part", "a text part is {'type': 'text', 'text': '...'}")
        return self


_GIVEN_CONTENT = {"type": ["string", "array"]}  # content that is there: text or parts, not null
_NO_TOOL_CALLS = {"type": "null"}

# The rules of ``ChatMessageIn._content_given``, one branch per kind of message, for the OpenAPI document (the
# properties' own schemas still apply): a client generated from it sends only messages the validator takes.
_BY_ROLE: list[dict[str, Any]] = [
    {
        "properties": {
            "role": {"enum": ["system", "user", "developer"]},
            "content": _GIVEN_CONTENT,
            "tool_calls": _NO_TOOL_CALLS,
        },
        "required": ["content"],
    },
    {"properties": {"role": {"const": "assistant"}, "content": _GIVEN_CONTENT}, "required": ["content"]},
    {
        "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
        "required": ["tool_calls"],
        "description": "Content may be null or left out when the message carries tool calls.",
    },
    {
        "properties": {
            "role": {"const": "tool"},
            "content": _GIVEN_CONTENT,
            "tool_call_id": {"type": "string"},
            "tool_calls": _NO_TOOL_CALLS,
        },
        "required": ["content", "tool_call_id"],
    },
]


class ChatMessageIn(_Body):
    """A chat message as clients send it; assistant messages may carry ``tool_calls`` and ``tool`` messages
    answer one by ``tool_call_id`` (both rendered by the model's chat template)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": _BY_ROLE})

    role: Annotated[
        Literal["system", "user", "assistant", "developer", "tool", "function"],
        _only("system", "user", "assistant", "developer", "tool", description="'function' messages are not supported."),
    ]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)
    refusal: str | None = None

    @field_validator("role")
    @classmethod
    def _no_function_role(cls, value: str) -> str:
        if value == "function":
            raise _unsupported("'function' messages are not supported; use 'tool' messages")
        return value

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessageIn:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def to_schema(self) -> ChatMessage:
        """The pipeline's chat message."""
        content: str | list[TextPart] | None
        if self.content is None or isinstance(self.content, str):
            content = self.content
        else:
            content = [TextPart(type="text", text=part.text or "") for part in self.content]
        return ChatMessage(
            role=self.role,  # type: ignore[arg-type]
            content=content,
            name=self.name,
            tool_calls=self.tool_calls,
            tool_call_id=self.tool_call_id,
        )
