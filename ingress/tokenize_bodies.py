"""The bodies and answers of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas import ChatMessage, ToolSpec
from sluicegate.api.bodies.base import MODEL_DESCRIPTION
from sluicegate.api.chat_messages import ChatMessageIn
from sluicegate.api.schema_rules import exactly_one, rules


class TokenizeBody(BaseModel):
    """``prompt`` (text) or ``messages`` (rendered through the chat template), as vLLM takes them."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=rules(exactly_one("prompt", "messages")))

    model: str = Field(min_length=1, description=MODEL_DESCRIPTION)
    prompt: str | None = None
    # As chat completions takes them (an assistant turn with tool_calls and no content, text parts...), so any
    # conversation the API serves can be counted.
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    tools: list[ToolSpec] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def chat_messages(self) -> list[ChatMessage]:
        """The pipeline's messages, as a chat request of the same conversation gets them."""
        return [m.to_schema() for m in self.messages or []]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description=MODEL_DESCRIPTION)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(
        max_length=1_000_000,
        description="Token ids of the model's vocabulary; an id past its end is a 400 token_out_of_vocabulary.",
    )


class DetokenizeResponse(BaseModel):
    prompt: str
