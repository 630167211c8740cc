"""``POST /v1/requests``' body: a prompt or messages, with any guided-decoding constraint."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
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
from .base import (
    DEFAULT_MAX_TOKENS,
    TOKEN_IDS_SCHEMA,
    SamplingBody,
    nullable,
)


class NativeRequestBody(SamplingBody):
    """``POST /v1/requests``: the completions fields plus ``guided`` and ``tools``."""

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
    guided: GuidedSpec | None = Field(
        None, description="Any constraint: json_schema, json_object, regex, choice, grammar."
    )
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
