"""Request bodies of the OpenAI-compatible and native endpoints: what each accepts and how it is checked
(:func:`ingress.accept.build_request` turns one into the pipeline's :class:`schemas.InferenceRequest`).

OpenAI fields Sluicegate does not implement (``n`` > 1, ``logprobs``, ``tools``...) are rejected with a
400 naming them instead of being ignored; fields that change nothing (``user``, ``metadata``...) are
accepted. vLLM-style extras (``top_k``, ``ignore_eos``, ``stop_token_ids``) and ``priority`` are
accepted on every endpoint.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas import (
    ChatMessage,
    SamplingOptions,
    TextPart,
    Tier,
    utcnow,
)

#: ``max_tokens`` when a chat or native request gives none (OpenAI's own default is "until the context
#: ends", which a queue-based service should not assume).
DEFAULT_MAX_TOKENS = 256
#: OpenAI's (and vLLM's) default for ``/v1/completions``.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Longest relative deadline (seconds from now) a request may give: a year, far past any queue wait.
MAX_DEADLINE_S = 365 * 86400


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def _only(*values: Any, description: str = "Not supported beyond these values.") -> WithJsonSchema:
    """The OpenAPI schema of a field Sluicegate accepts only in its inert values (its validator answers 400
    ``unsupported_parameter`` to the rest), so the document says what is accepted rather than OpenAI's type."""
    return WithJsonSchema({"enum": list(values), "description": description})


def _nullable(schema: dict[str, Any], description: str = "") -> WithJsonSchema:
    """``schema`` or null, for the OpenAPI document."""
    documented: dict[str, Any] = {"anyOf": [schema, {"type": "null"}]}
    if description:
        documented["description"] = description
    return WithJsonSchema(documented)


_NOTHING = _nullable({"type": "array", "maxItems": 0}, "Tool and function calling are not supported.")


class _Body(BaseModel):
    # Unknown fields are reported, never silently dropped.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    """OpenAI's ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: Annotated[bool, _only(False)] = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, value: bool) -> bool:
        if value:
            raise _unsupported("per-chunk usage statistics are not supported")
        return value


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


class ChatMessageIn(_Body):
    """A chat message as clients send it."""

    role: Annotated[
        Literal["system", "user", "assistant", "developer", "tool", "function"],
        _only("system", "user", "assistant", "developer", description="Tool and function messages are not supported."),
    ]
    content: str | list[ContentPart]
    name: str | None = Field(None, max_length=256)

    @field_validator("role")
    @classmethod
    def _no_tool_roles(cls, value: str) -> str:
        if value in ("tool", "function"):
            raise _unsupported(f"'{value}' messages are not supported (no tool calling)")
        return value

    def to_schema(self) -> ChatMessage:
        """The pipeline's chat message."""
        content: str | list[TextPart]
        if isinstance(self.content, str):
            content = self.content
        else:
            content = [TextPart(type="text", text=part.text or "") for part in self.content]
        return ChatMessage(role=self.role, content=content, name=self.name)  # type: ignore[arg-type]


StopField = Annotated[
    str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
                {"type": "null"},
            ]
        }
    ),
]


class _SamplingBody(_Body):
    """Fields every endpoint shares: model, sampling, priority."""

    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[int | None, _nullable({"type": "integer", "minimum": -1}, "vLLM-style: -1 or 0 disables.")] = None
    stop: StopField = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    priority: Tier | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("top_k must be >= 1, or -1/0 to disable it")
        return value if value is None or value >= 1 else None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value == "":
            raise ValueError("a stop string must not be empty")
        return value

    def sampling(self, max_tokens: int) -> SamplingOptions:
        """The pipeline's sampling options."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingOptions(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


def _reject_unless(value: Any, allowed: tuple[Any, ...], message: str) -> Any:
    if value not in allowed:
        raise _unsupported(message)
    return value


class _OpenAIBody(_SamplingBody):
    """Fields both OpenAI endpoints share."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int | None, _only(1, None, description="One choice per request.")] = None
    presence_penalty: Annotated[float | None, _only(0, None)] = None
    frequency_penalty: Annotated[float | None, _only(0, None)] = None
    logit_bias: Annotated[dict[str, float] | None, _nullable({"type": "object", "maxProperties": 0})] = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        return _reject_unless(value, (None, 1), "n > 1 is not supported; send one request per choice")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        return _reject_unless(value, (None, 0, 0.0), "presence/frequency penalties are not supported")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return _reject_unless(value or None, (None,), "logit_bias is not supported")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # ``stream`` is declared first, so it is already validated here.
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionBody(_OpenAIBody):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: Annotated[bool | None, _only(False, None)] = None
    top_logprobs: Annotated[int | None, _only(0, None)] = None
    tools: Annotated[list[Any] | None, _NOTHING] = None
    tool_choice: Annotated[Any, _only("none", None)] = None
    functions: Annotated[list[Any] | None, _NOTHING] = None
    function_call: Annotated[Any, _only("none", None)] = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[
        dict[str, Any] | None,
        _nullable(
            {
                "type": "object",
                "properties": {"type": {"const": "text"}},
                "required": ["type"],
                "additionalProperties": False,
            },
            "Only plain text output.",
        ),
    ] = None
    modalities: Annotated[list[str] | None, _nullable({"type": "array", "items": {"const": "text"}, "minItems": 1})] = (
        None
    )
    audio: Annotated[Any, _only(None)] = None
    prediction: Annotated[Any, _only(None)] = None
    reasoning_effort: Annotated[str | None, _only(None)] = None
    web_search_options: Annotated[Any, _only(None)] = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        return _reject_unless(value, (None, False), "logprobs are not supported")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        return _reject_unless(value, (None, 0), "top_logprobs is not supported")

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        return _reject_unless(value or None, (None,), "tool and function calling are not supported")

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        return _reject_unless(value, (None, "none"), "tool and function calling are not supported")

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise _unsupported("only response_format {'type': 'text'} is supported")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and set(value) != {"text"}:
            raise _unsupported("only the 'text' modality is supported")
        return value

    @field_validator("audio", "prediction", "reasoning_effort", "web_search_options")
    @classmethod
    def _absent(cls, value: Any) -> Any:
        return _reject_unless(value, (None,), "this parameter is not supported")

    def resolved_max_tokens(self) -> int:
        """``max_completion_tokens`` (the newer name) over ``max_tokens`` over the default."""
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def chat_messages(self) -> list[ChatMessage]:
        """The pipeline's chat messages."""
        return [m.to_schema() for m in self.messages]


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PromptField = Annotated[
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]], Field(min_length=1)],
    WithJsonSchema(
        {
            "description": "One prompt: text, token ids, or a one-element list of either.",
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                _TOKEN_IDS_SCHEMA,
                {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": 1},
            ],
        }
    ),
]


class CompletionBody(_OpenAIBody):
    """``POST /v1/completions``."""

    prompt: PromptField
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1, le=1_000_000)
    echo: Annotated[bool | None, _only(False, None)] = None
    suffix: Annotated[str | None, _only("", None)] = None
    best_of: Annotated[int | None, _only(1, None)] = None
    logprobs: Annotated[int | None, _only(None)] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if isinstance(value[0], int):
            return value  # type: ignore[return-value]
        if len(value) > 1:
            raise _unsupported("a list of several prompts is not supported; send one request per prompt")
        only = value[0]
        if isinstance(only, str) and not only:
            raise ValueError("prompt must not be empty")
        return only  # type: ignore[return-value]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        return _reject_unless(value, (None, False), "echo is not supported")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _reject_unless(value or None, (None,), "suffix (insertion) is not supported")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _reject_unless(value, (None, 1), "best_of > 1 is not supported")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        return _reject_unless(value, (None,), "logprobs are not supported")

    def resolved_max_tokens(self) -> int:
        """``max_tokens`` or the completions default."""
        return self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS


class NativeRequestBody(_SamplingBody):
    """``POST /v1/requests``: the completions fields plus ``ignore_eos``, ``priority`` and ``deadline``
    (an ISO 8601 time with a zone, or seconds from now)."""

    prompt: Annotated[
        str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None,
        _nullable(
            {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS_SCHEMA]},
            "Text or token ids; give exactly one of prompt and messages.",
        ),
    ] = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)] | None = None
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=1_000_000)
    deadline: AwareDatetime | Annotated[float, Field(gt=0, le=MAX_DEADLINE_S)] | None = None

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
        return self

    def absolute_deadline(self, now: datetime | None = None) -> datetime | None:
        """The deadline as an aware datetime (relative seconds counted from ``now``)."""
        if self.deadline is None or isinstance(self.deadline, datetime):
            return self.deadline
        return (now or utcnow()) + timedelta(seconds=self.deadline)

    def resolved_max_tokens(self) -> int:
        """``max_tokens``."""
        return self.max_tokens


AnyBody = ChatCompletionBody | CompletionBody | NativeRequestBody
