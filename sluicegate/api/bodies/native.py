"""``POST /v1/requests``' body: a prompt or messages, with any guided-decoding constraint."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from schemas import (
    MAX_TOP_LOGPROBS,
    GuidedSpec,
    ToolSpec,
)

from ..chat_messages import ChatMessageIn
from ..response_format import ResponseFormat, guided_for
from ..schema_rules import any_of, at_most_one, exactly_one, given, has, rules
from .base import (
    DEFAULT_MAX_TOKENS,
    TOKEN_IDS_SCHEMA,
    SamplingBody,
    nullable,
)

_NULL = {"type": "null"}
#: Each kind of constraint ``guided`` may hold, with the value that gives it.
_GUIDED_KINDS: dict[str, dict[str, Any]] = {
    "json_schema": {"type": "object", "description": "A JSON Schema the output must match."},
    "json_object": {"type": "boolean", "description": "true: any JSON object."},
    "regex": {"type": "string", "minLength": 1, "maxLength": 10_000, "format": "regex"},
    "choice": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1024},
    "grammar": {"type": "string", "minLength": 1, "maxLength": 100_000, "description": "An EBNF grammar."},
}


def _guided_only(kind: str) -> dict[str, Any]:
    """``guided`` holding ``kind`` and nothing else (json_object false and the others null count as not given)."""
    others = {name: _NULL for name in _GUIDED_KINDS if name not in (kind, "json_object")}
    if kind != "json_object":
        others["json_object"] = {"const": False}
    value = {"const": True} if kind == "json_object" else _GUIDED_KINDS[kind]
    return {"properties": {kind: value} | others, "required": [kind]}


# schemas.GuidedSpec as this body takes it: its validator wants exactly one kind of constraint, which the wire
# contract's own schema does not say.
_GUIDED_SCHEMA = nullable(
    {
        "type": "object",
        "properties": {
            name: {"anyOf": [kind, _NULL]} if name != "json_object" else kind for name, kind in _GUIDED_KINDS.items()
        },
        "additionalProperties": False,
        "oneOf": [_guided_only(kind) for kind in _GUIDED_KINDS],
    },
    "Exactly one constraint: json_schema, json_object (true), regex, choice or grammar.",
)

#: The rules of ``NativeRequestBody._one_input``.
NATIVE_RULES = (
    exactly_one("prompt", "messages"),
    at_most_one("guided", "response_format"),
    # tools are rendered by the chat template, so they need messages.
    any_of(has("tools", {"anyOf": [_NULL, {"type": "array", "maxItems": 0}]}), given("messages")),
)


class NativeRequestBody(SamplingBody):
    """``POST /v1/requests``: the completions fields plus ``guided`` and ``tools``."""

    model_config = ConfigDict(json_schema_extra=rules(*NATIVE_RULES))

    prompt: Annotated[
        str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None,
        nullable(
            {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS_SCHEMA]},
            "Text or token ids; give exactly one of prompt and messages.",
        ),
    ] = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)] | None = None
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=1_000_000)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Top alternatives per token.")
    response_format: ResponseFormat | None = None
    guided: Annotated[GuidedSpec | None, _GUIDED_SCHEMA] = None
    tools: list[ToolSpec] | None = Field(None, max_length=128, description="Rendered by the chat template.")

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value == "":
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> NativeRequestBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be given")
        if self.guided is not None and self.response_format is not None:
            raise ValueError("give at most one of 'guided' and 'response_format'")
        if self.tools and self.messages is None:
            raise ValueError("'tools' need 'messages' (the chat template renders them)")
        return self

    def token_logprobs(self) -> int | None:
        """``logprobs``."""
        return self.logprobs

    def guided_spec(self) -> GuidedSpec | None:
        """``guided`` as given, or from ``response_format``."""
        return self.guided or guided_for(None, None, self.response_format, None)

    def resolved_max_tokens(self) -> int:
        """``max_tokens``."""
        return self.max_tokens
