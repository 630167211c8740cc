"""What every request body shares: the strict base, the deadline, sampling and OpenAI streaming fields, and the
helpers that refuse an OpenAI field Sluicegate does not implement with a 400 naming it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from schemas import (
    EndUser,
    GuidedSpec,
    SamplingOptions,
    Tier,
    utcnow,
)

from ..deadlines import DeadlineField, absolute_deadline
from ..schema_rules import any_of, given, left_out, rules

#: ``max_tokens`` when a chat or native request gives none (OpenAI's own default is "until the context
#: ends", which a queue-based service should not assume).
DEFAULT_MAX_TOKENS = 256
#: OpenAI's (and vLLM's) default for ``/v1/completions``.
DEFAULT_COMPLETION_MAX_TOKENS = 16


def unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def only(*values: Any, description: str = "Not supported beyond these values.") -> WithJsonSchema:
    """The OpenAPI schema of a field Sluicegate accepts only in its inert values (its validator answers 400
    ``unsupported_parameter`` to the rest), so the document says what is accepted rather than OpenAI's type."""
    return WithJsonSchema({"enum": list(values), "description": description})


def nullable(schema: dict[str, Any], description: str = "") -> WithJsonSchema:
    """``schema`` or null, for the OpenAPI document."""
    documented: dict[str, Any] = {"anyOf": [schema, {"type": "null"}]}
    if description:
        documented["description"] = description
    return WithJsonSchema(documented)


NOTHING = nullable({"type": "array", "maxItems": 0}, "Tool and function calling are not supported.")


#: What JSON Schema cannot say of a request's model: which names are served is the server's state.
MODEL_DESCRIPTION = (
    "A model with a live worker (or a routed name, or a LoRA adapter the key may use): GET /v1/models lists them; "
    "any other is a 404 model_not_found."
)


class Body(BaseModel):
    # Unknown fields are reported, never silently dropped.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
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


class DeadlineBody(Body):
    """A request that may carry a deadline (:mod:`.deadlines`; also the X-Request-Deadline header)."""

    deadline: DeadlineField | None = None

    def absolute_deadline(self, now: datetime | None = None) -> datetime | None:
        """The deadline as an aware datetime (relative seconds counted from ``now``)."""
        return absolute_deadline(self.deadline, now or utcnow())


class SamplingBody(DeadlineBody):
    """Fields every endpoint shares: model, sampling, priority."""

    model: str = Field(min_length=1, max_length=256, description=MODEL_DESCRIPTION)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[int | None, nullable({"type": "integer", "minimum": -1}, "vLLM-style: -1 or 0 disables.")] = None
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
    logit_bias: Annotated[
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]] | None,
        # pydantic documents the key pattern as patternProperties alone, which lets any other key through.
        nullable(
            {
                "type": "object",
                "patternProperties": {r"^[0-9]{1,9}$": {"type": "number", "minimum": -100, "maximum": 100}},
                "additionalProperties": False,
                "maxProperties": 1024,
            },
            "Token id -> bias added to its logit.",
        ),
    ] = Field(None, max_length=1024)

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


def reject_unless(value: Any, allowed: tuple[Any, ...], message: str) -> Any:
    if value not in allowed:
        raise unsupported(message)
    return value


#: ``stream_options`` only with ``stream`` (``OpenAIBody._stream_options_need_stream``).
STREAM_OPTIONS_NEED_STREAM = any_of(left_out("stream_options"), given("stream", {"const": True}))


class OpenAIBody(SamplingBody):
    """Fields both OpenAI endpoints share."""

    model_config = ConfigDict(json_schema_extra=rules(STREAM_OPTIONS_NEED_STREAM))

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


#: A list of token ids, for the OpenAPI document (where ingress knows the model's vocabulary, an id past its end is
#: a 400 token_out_of_vocabulary; the vocabulary is the model's, so the document cannot bound it).
TOKEN_IDS_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0},
    "minItems": 1,
    "description": "Token ids of the model's vocabulary.",
}
