"""``POST /v1/completions``' body: one prompt, or on the online endpoint a list of prompts each sent as its own
request."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from schemas import (
    MAX_TOP_LOGPROBS,
    GuidedSpec,
)

from ..response_format import ResponseFormat, guided_for
from .base import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    TOKEN_IDS_SCHEMA,
    OpenAIBody,
    only,
    reject_unless,
    unsupported,
)

#: Most prompts one ``/v1/completions`` call may carry (as many as an embeddings call's inputs).
MAX_COMPLETION_PROMPTS = 2048
#: Validation context under which ``CompletionBody`` takes a list of several prompts: the online endpoint, which
#: sends each as its own request. Elsewhere (a batch line, one request) several prompts are refused by name.
SEVERAL_PROMPTS = {"several_prompts": True}
PromptField = Annotated[
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]], Field(min_length=1)],
    WithJsonSchema(
        {
            "description": (
                "A prompt (text or token ids), or a list of prompts: each is its own request, and its choices "
                "follow the previous prompt's in `choices` (prompt i's choice j has index i * n + j). A batch "
                "line takes one prompt."
            ),
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": MAX_COMPLETION_PROMPTS,
                },
                TOKEN_IDS_SCHEMA,
                {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_COMPLETION_PROMPTS},
            ],
        }
    ),
]


class CompletionBody(OpenAIBody):
    """``POST /v1/completions``."""

    prompt: PromptField
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1, le=1_000_000)
    echo: Annotated[bool | None, only(False, None)] = None
    suffix: Annotated[str | None, only("", None)] = None
    best_of: Annotated[int | None, only(1, None)] = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, value: str | list[str] | list[int] | list[list[int]], info: ValidationInfo
    ) -> str | list[int] | list[str] | list[list[int]]:
        """One prompt as it is (a one-element list unwrapped); several only under ``SEVERAL_PROMPTS``."""
        if isinstance(value, str) or isinstance(value[0], int):
            prompts: list[Any] = [value]
        else:
            prompts = value
            if len(prompts) > 1 and not (info.context or {}).get("several_prompts"):
                raise unsupported("a list of several prompts is not supported here; send one request per prompt")
            if len(prompts) > MAX_COMPLETION_PROMPTS:
                raise ValueError(f"at most {MAX_COMPLETION_PROMPTS} prompts per request, got {len(prompts)}")
        if any(isinstance(p, str) and not p for p in prompts):
            raise ValueError("prompt must not be empty")
        return prompts[0] if len(prompts) == 1 else value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the body (one, unless the online endpoint took a list)."""
        prompt = self.prompt
        several = isinstance(prompt, list) and not isinstance(prompt[0], int)
        return list(prompt) if several else [prompt]  # type: ignore[arg-type, list-item]

    def one_per_prompt(self) -> list[CompletionBody]:
        """The body once per prompt, each a request of its own."""
        return [self.model_copy(update={"prompt": p}) for p in self.prompts()]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        return reject_unless(value, (None, False), "echo is not supported")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return reject_unless(value or None, (None,), "suffix (insertion) is not supported")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return reject_unless(value, (None, 1), "best_of > 1 is not supported")

    def token_logprobs(self) -> int | None:
        """``logprobs`` (an int on this endpoint)."""
        return self.logprobs

    def guided_spec(self) -> GuidedSpec | None:
        """From ``response_format`` (a vLLM extra on completions)."""
        return guided_for(None, None, self.response_format, None)

    def resolved_max_tokens(self) -> int:
        """``max_tokens`` or the completions default."""
        return self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
