"""``POST /v1/chat/completions``'s body: messages, tools, ``response_format`` and the fields OpenAI deprecated."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas import (
    MAX_TOP_LOGPROBS,
    ChatMessage,
    ChatTemplateKwargs,
    GuidedSpec,
    ToolSpec,
    check_regex,
)

from ..chat_messages import ChatMessageIn
from ..response_format import ResponseFormat, ToolChoice, guided_for
from ..schema_rules import any_of, every, given, has, left_out, rules
from .base import (
    DEFAULT_MAX_TOKENS,
    NOTHING,
    STREAM_OPTIONS_NEED_STREAM,
    OpenAIBody,
    nullable,
    only,
    reject_unless,
    unsupported,
)

# The tool_choice values that force no call; any other (required, a named function) forces one.
_NOT_FORCED = has("tool_choice", {"enum": ["none", "auto", None]})
_PLAIN_TEXT = has("response_format", {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]})
_SOME_TOOLS = given("tools", {"type": "array", "minItems": 1})

#: What ``guided_for`` checks between the fields, as far as JSON Schema can say it (a named function must also be
#: one of ``tools``; that is in the field's description).
CHAT_RULES = (
    STREAM_OPTIONS_NEED_STREAM,
    # top_logprobs needs logprobs: true.
    any_of(has("top_logprobs", {"enum": [0, None]}), given("logprobs", {"const": True})),
    # A forced tool_choice needs tools to call, and leaves no room for a response_format.
    any_of(_NOT_FORCED, every(_SOME_TOOLS, _PLAIN_TEXT)),
    # guided_regex is the only constraint when given.
    any_of(left_out("guided_regex"), every(_NOT_FORCED, _PLAIN_TEXT)),
)


class ChatCompletionBody(OpenAIBody):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(json_schema_extra=rules(*CHAT_RULES))

    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        None, description="'required' or a named function needs tools; a named function must be one of them."
    )
    functions: Annotated[list[Any] | None, NOTHING] = None
    function_call: Annotated[Any, only("none", None)] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra_body name: the output must match this regular expression.
    guided_regex: Annotated[
        str | None,
        nullable({"type": "string", "minLength": 1, "maxLength": 10_000, "format": "regex"}),
    ] = Field(None, min_length=1, max_length=10_000)
    _guided: GuidedSpec | None = PrivateAttr(None)
    # vLLM's extra_body name: extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: ChatTemplateKwargs | None = None
    modalities: Annotated[list[str] | None, nullable({"type": "array", "items": {"const": "text"}, "minItems": 1})] = (
        None
    )
    audio: Annotated[Any, only(None)] = None
    prediction: Annotated[Any, only(None)] = None
    reasoning_effort: Annotated[str | None, only(None)] = None
    web_search_options: Annotated[Any, only(None)] = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Inert here, as on /v1/responses: the prefix cache needs no key, and there is no abuse monitoring to inform.
    prompt_cache_key: str | None = Field(None, max_length=1024)
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    verbosity: Annotated[Literal["low", "medium", "high"] | None, only("medium", None)] = None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list[Any] | None) -> list[Any] | None:
        return reject_unless(value or None, (None,), "'functions' is deprecated and not supported; use 'tools'")

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        return reject_unless(
            value, (None, "none"), "'function_call' is deprecated and not supported; use 'tool_choice'"
        )

    # Fields are validated in declaration order, so each check below sees the fields it depends on.
    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs_needs_logprobs", "top_logprobs needs logprobs set to true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_offered(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        guided_for(info.data.get("tools"), value, None, None)  # raises for a choice the tools cannot meet
        return value

    @field_validator("response_format")
    @classmethod
    def _one_constraint(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        guided_for(info.data.get("tools"), info.data.get("tool_choice"), value, None)
        return value

    @field_validator("guided_regex")
    @classmethod
    def _regex_alone(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            check_regex(value)
        data = info.data
        guided_for(data.get("tools"), data.get("tool_choice"), data.get("response_format"), None, value)
        return value

    @model_validator(mode="after")
    def _constraint(self) -> ChatCompletionBody:
        self._guided = guided_for(
            self.tools, self.tool_choice, self.response_format, self.parallel_tool_calls, self.guided_regex
        )
        return self

    def token_logprobs(self) -> int | None:
        """``top_logprobs`` alternatives when ``logprobs`` is true."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def guided_spec(self) -> GuidedSpec | None:
        """From ``response_format`` or a forced ``tool_choice``."""
        return self._guided

    def offered_tools(self) -> list[ToolSpec] | None:
        """The tools the chat template renders (none when ``tool_choice`` is 'none')."""
        return None if self.tool_choice == "none" else self.tools

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and set(value) != {"text"}:
            raise unsupported("only the 'text' modality is supported")
        return value

    @field_validator("verbosity")
    @classmethod
    def _medium_verbosity(cls, value: str | None) -> str | None:
        return reject_unless(value, (None, "medium"), "verbosity other than 'medium' is not supported")

    @field_validator("audio", "prediction", "reasoning_effort", "web_search_options")
    @classmethod
    def _absent(cls, value: Any) -> Any:
        return reject_unless(value, (None,), "this parameter is not supported")

    def resolved_max_tokens(self) -> int:
        """``max_completion_tokens`` (the newer name) over ``max_tokens`` over the default."""
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def chat_messages(self) -> list[ChatMessage]:
        """The pipeline's chat messages."""
        return [m.to_schema() for m in self.messages]
