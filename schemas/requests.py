"""The inference request every producer puts on Kafka, and the chat message shape it may carry."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, Field, JsonValue, field_validator, model_validator

from .adapters import AdapterName
from .common import SCHEMA_VERSION, Message, RequestId, utcnow
from .generation import MAX_TOP_LOGPROBS, GuidedSpec, ToolCall, ToolSpec
from .names import Tier

TokenId = Annotated[int, Field(ge=0)]

#: What a request asks of the model: text generated from the prompt, or the prompt's embedding (a prefill-only
#: request whose result is one vector; it travels the same topics and is batched with generation).
Task = Literal["generate", "embed"]
#: How an embedding pools the final normed hidden states: the last prompt token's (the default, vLLM's for
#: decoder models) or the mean over every prompt token; either is L2-normalized.
Pooling = Literal["last", "mean"]

#: An ingress instance that relays requests' output to their HTTP clients (its reader lease's name).
ReaderId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="An ingress instance's reader id.")]

#: The end user a request is made for (OpenAI's ``user``): a route sticky per user keeps them on one version.
EndUser = Annotated[
    str,
    Field(
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="The end user the request is made for (no control characters); routes may stick to it.",
    ),
]


class TextPart(Message):
    """One text part of an OpenAI-style content array."""

    type: Literal["text"]
    text: str


class ChatMessage(Message):
    """One OpenAI chat message; content may be a string or an array of text parts. An assistant message may
    carry the ``tool_calls`` it made (content then may be null); a ``tool`` message answers one by
    ``tool_call_id``."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only on an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        """The message content as one string: text parts one per line, as vLLM joins them (joined with nothing,
        "Part one." and "Part two." ran together as "Part one.Part two.")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class SamplingOptions(Message):
    """How to sample: the OpenAI fields plus top_k, stop token ids, seed and ignore_eos."""

    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, description="None disables top-k.")
    max_tokens: int = Field(256, ge=1, le=1_000_000)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="HF semantics, over prompt + output.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = Field(None, max_length=1024, description="Token id (as a string, JSON keys are strings) -> bias.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="None: none; k: the sampled token's logprob and the top k."
    )
    n: int = Field(1, ge=1, le=32, description="Choices sharing one prompt (its KV blocks are shared).")


class TraceContext(Message):
    """W3C trace context; it also travels in Kafka headers, this copy survives re-publishing."""

    traceparent: str = Field(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
    tracestate: str | None = None


# Names the chat template gets from the pipeline itself: a client's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "tokenize", "continue_final_message"}
)


def _template_kwargs_free(value: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(value or {}) & RESERVED_TEMPLATE_NAMES)
    if taken:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)} (the pipeline sets them)")
    return value


#: Extra variables for the chat template (vLLM's ``chat_template_kwargs``), e.g. Qwen3's ``enable_thinking``.
ChatTemplateKwargs = Annotated[
    dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")], JsonValue],
    # The document says what the validators enforce: only the pattern's names, none of the reserved ones.
    Field(
        max_length=32,
        json_schema_extra={
            "additionalProperties": False,
            "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_NAMES)}},
        },
    ),
    AfterValidator(_template_kwargs_free),
]


class InferenceRequest(Message):
    """One generation (or embedding) request as it travels on ``llm.inbound`` and ``llm.<model>.<tier>``."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
    model: str = Field(min_length=1, max_length=256)
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        None, description="Text, or token ids. Exactly one of prompt and messages."
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    guided: GuidedSpec | None = Field(None, description="Constrain the output (JSON Schema, regex...).")
    tools: list[ToolSpec] | None = Field(None, max_length=128, description="Tools the chat template renders.")
    # Optional, so producers that predate it are unaffected.
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking); messages only."
    )
    priority: Tier = "standard"
    tenant: str = Field("default", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")
    # Optional, like ``user``: the API key's short id when ingress or a batch accepted the request (usage ledger).
    key_id: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")
    # Optional, so producers that predate it are unaffected; a routed model sticky per user hashes it.
    user: EndUser | None = None
    deadline: AwareDatetime | None = Field(None, description="Absolute time after which not to start.")
    created_at: AwareDatetime = Field(default_factory=utcnow)
    trace: TraceContext | None = None
    # Optional, so producers that predate them are unaffected: an embedding request names its task (and pooling).
    task: Task = Field("generate", description="generate: text from the prompt; embed: the prompt's embedding.")
    pooling: Pooling | None = Field(None, description="embed only: last (default) or mean; L2-normalized.")
    # Optional, so producers that predate it are unaffected: a LoRA adapter of ``model`` (which stays the base
    # model's name, so the request keeps the base model's topic).
    adapter: AdapterName | None = Field(
        None, description="A registered LoRA adapter of 'model' to apply (its name); None: the base model."
    )
    # Optional, so producers that predate it are unaffected: who relays the output to a client that cannot resume
    # it (an OpenAI-style HTTP response). Workers stop the request once that reader's lease lapses in Redis
    # (``Names.reader_key``): its client is gone with it, so nobody would read what it makes.
    reader: ReaderId | None = Field(
        None,
        description="The ingress instance relaying the output to a client that cannot resume it; workers stop the "
        "request once its lease key lapses. None: the output is read from the stream (resumable) or by a batch.",
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | list[int] | None) -> str | list[int] | None:
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> InferenceRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be given")
        if self.tools and self.messages is None:
            raise ValueError("'tools' need 'messages' (they are rendered by the chat template)")
        if self.chat_template_kwargs and self.messages is None:
            raise ValueError("'chat_template_kwargs' need 'messages' (they are passed to the chat template)")
        if self.task == "embed":
            if self.prompt is None or self.guided is not None or self.sampling.n != 1:
                raise ValueError("an 'embed' request takes a 'prompt' (no messages, guided or n > 1)")
        elif self.pooling is not None:
            raise ValueError("'pooling' is for task 'embed' only")
        return self

    @property
    def embedding_pooling(self) -> Pooling | None:
        """How to pool the prompt when this is an embedding request (None: it generates)."""
        return (self.pooling or "last") if self.task == "embed" else None

    def expired(self, now: datetime | None = None) -> bool:
        """True when the request carries a deadline that has passed."""
        return self.deadline is not None and (now or utcnow()) >= self.deadline

    def deadline_epoch(self) -> float | None:
        """The deadline as ``time.time()`` seconds (what the engine and the worker's intake order by), or None."""
        return None if self.deadline is None else self.deadline.timestamp()
