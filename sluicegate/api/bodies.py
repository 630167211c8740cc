"""Request bodies of the OpenAI-compatible and native endpoints: what each accepts and how it is checked
(:func:`sluicegate.api.build.build_request` turns one into the pipeline's :class:`schemas.InferenceRequest`).

OpenAI fields Sluicegate does not implement (``functions``, ``audio``, ``echo``...) are rejected with a
400 naming them instead of being ignored; fields that change nothing (``user``, ``metadata``...) are
accepted. vLLM-style extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``) and ``priority`` are accepted on every endpoint. ``response_format`` and a forced
``tool_choice`` become a :class:`schemas.GuidedSpec` (:mod:`sluicegate.api.tool_calls` builds the tool-call schema).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from schemas import (
    MAX_TOP_LOGPROBS,
    ChatMessage,
    EndUser,
    GuidedSpec,
    Pooling,
    SamplingOptions,
    Tier,
    ToolSpec,
    utcnow,
)

from .chat_messages import ChatMessageIn
from .deadlines import DeadlineField, absolute_deadline
from .response_format import ResponseFormat, ToolChoice, guided_for

#: ``max_tokens`` when a chat or native request gives none (OpenAI's own default is "until the context
#: ends", which a queue-based service should not assume).
DEFAULT_MAX_TOKENS = 256
#: OpenAI's (and vLLM's) default for ``/v1/completions``.
DEFAULT_COMPLETION_MAX_TOKENS = 16


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
    """OpenAI's ``stream_options``, plus vLLM's ``continuous_usage_stats``: with ``include_usage`` too, every
    chunk carries the running usage (load generators such as guidellm send it on every request)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


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


class _DeadlineBody(_Body):
    """A request that may carry a deadline (:mod:`.deadlines`; also the X-Request-Deadline header)."""

    deadline: DeadlineField | None = None

    def absolute_deadline(self, now: datetime | None = None) -> datetime | None:
        """The deadline as an aware datetime (relative seconds counted from ``now``)."""
        return absolute_deadline(self.deadline, now or utcnow())


class _SamplingBody(_DeadlineBody):
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
    n: int | None = Field(None, ge=1, le=32, description="Choices; they share the prompt's KV cache.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="vLLM-style, over prompt + output.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = Field(None, max_length=1024, description="Token id -> bias added to its logit.")

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

    def token_logprobs(self) -> int | None:
        """How many alternatives per token to return logprobs for (None: no logprobs)."""
        return None

    def guided_spec(self) -> GuidedSpec | None:
        """The constraint on the output, if any."""
        return None

    def sampling(self, max_tokens: int) -> SamplingOptions:
        """The pipeline's sampling options."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingOptions(
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            min_p=self.min_p or 0.0,
            logit_bias={key: float(value) for key, value in self.logit_bias.items()} if self.logit_bias else None,
            logprobs=self.token_logprobs(),
            n=self.n or 1,
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
    user: EndUser | None = None

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

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the running usage (vLLM's rule: only together with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionBody(_OpenAIBody):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    functions: Annotated[list[Any] | None, _NOTHING] = None
    function_call: Annotated[Any, _only("none", None)] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra_body name: the output must match this regular expression.
    guided_regex: str | None = Field(None, min_length=1, max_length=10_000)
    _guided: GuidedSpec | None = PrivateAttr(None)
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

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list[Any] | None) -> list[Any] | None:
        return _reject_unless(value or None, (None,), "'functions' is deprecated and not supported; use 'tools'")

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        return _reject_unless(
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
                _TOKEN_IDS_SCHEMA,
                {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_COMPLETION_PROMPTS},
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
                raise _unsupported("a list of several prompts is not supported here; send one request per prompt")
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
        return _reject_unless(value, (None, False), "echo is not supported")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _reject_unless(value or None, (None,), "suffix (insertion) is not supported")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _reject_unless(value, (None, 1), "best_of > 1 is not supported")

    def token_logprobs(self) -> int | None:
        """``logprobs`` (an int on this endpoint)."""
        return self.logprobs

    def guided_spec(self) -> GuidedSpec | None:
        """From ``response_format`` (a vLLM extra on completions)."""
        return guided_for(None, None, self.response_format, None)

    def resolved_max_tokens(self) -> int:
        """``max_tokens`` or the completions default."""
        return self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS


class NativeRequestBody(_SamplingBody):
    """``POST /v1/requests``: the completions fields plus ``guided`` and ``tools``."""

    prompt: Annotated[
        str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None,
        _nullable(
            {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS_SCHEMA]},
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


class EmbeddingInput(_DeadlineBody):
    """One input of ``POST /v1/embeddings`` (:class:`sluicegate.api.embeddings.EmbeddingBody` splits a list into
    these): accepted like any other request, and built into one prefill-only ``task: embed`` request."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    pooling: Pooling = "last"
    priority: Tier | None = None
    user: EndUser | None = None

    def guided_spec(self) -> GuidedSpec | None:
        return None

    def resolved_max_tokens(self) -> int:
        """1: an embedding generates nothing, but the contract's ``max_tokens`` is at least 1 (the engine ignores
        it; the context check counts the prompt alone)."""
        return 1

    def sampling(self, max_tokens: int) -> SamplingOptions:
        """The defaults (never deterministic-looking, so never a response-cache entry)."""
        return SamplingOptions(max_tokens=1)


AnyBody = ChatCompletionBody | CompletionBody | NativeRequestBody | EmbeddingInput
