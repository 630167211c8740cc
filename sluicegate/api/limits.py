"""Per-key request limits: what a keys-file entry may set, how it falls back to the settings' defaults, a cheap
prompt-size estimate, and the checks that turn an oversized request into a 400 naming the limit.

Token counts are estimates, not tokenizer output: ingress serves any model by name and must stay cheap. Token
id prompts count exactly; text counts one token per four UTF-8 bytes (close to BPE tokenizers on English, and
not an undercount on scripts whose characters take several bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field

from schemas import InferenceRequest, WorkerHeartbeat
from sluicegate.settings import IngressSettings

from .bodies import AnyBody, ChatCompletionBody, CompletionBody, EmbeddingInput
from .deadlines import MAX_DEADLINE_S
from .errors import ApiError

#: Bytes of UTF-8 text per estimated token.
BYTES_PER_TOKEN = 4
#: Tokens a chat template adds around each message (role markers, separators).
TOKENS_PER_MESSAGE = 4


class KeyLimits(BaseModel):
    """Limits a keys-file entry may set; a field left out (None) takes the settings' ``limit_*`` default and 0
    means unlimited."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rps: float | None = Field(None, ge=0, description="Requests per second.")
    rpm: int | None = Field(None, ge=0, description="Requests per minute.")
    tpm: int | None = Field(None, ge=0, description="Tokens (prompt estimate + max_tokens) per minute.")
    max_prompt_tokens: int | None = Field(None, ge=0, description="Largest prompt, in estimated tokens.")
    max_tokens: int | None = Field(None, ge=0, description="Largest max_tokens a request may ask for.")
    max_body_bytes: int | None = Field(None, ge=1024, description="Largest request body (413 above).")
    default_queue_budget_s: float | None = Field(
        None, ge=0, le=MAX_DEADLINE_S, description="Queue-time budget: a request without a deadline starts within it."
    )
    tokens_per_day: int | None = Field(None, ge=0, description="Token quota per UTC day (prompt + output).")
    tokens_per_month: int | None = Field(None, ge=0, description="Token quota per UTC month (prompt + output).")

    def resolve(self, settings: IngressSettings) -> Limits:
        """The limits in force for this key."""

        def pick(own: float | None, default: float) -> float:
            return default if own is None else own

        return Limits(
            rps=pick(self.rps, settings.limit_rps),
            rpm=int(pick(self.rpm, settings.limit_rpm)),
            tpm=int(pick(self.tpm, settings.limit_tpm)),
            max_prompt_tokens=int(pick(self.max_prompt_tokens, settings.limit_prompt_tokens)),
            max_tokens=int(pick(self.max_tokens, settings.limit_max_tokens)),
            max_body_bytes=int(pick(self.max_body_bytes, settings.max_body_bytes)),
            queue_budget_s=pick(self.default_queue_budget_s, settings.default_queue_budget_s),
            tokens_per_day=int(pick(self.tokens_per_day, settings.limit_tokens_per_day)),
            tokens_per_month=int(pick(self.tokens_per_month, settings.limit_tokens_per_month)),
        )


@dataclass(frozen=True)
class Limits:
    """The limits in force for one key; 0 means unlimited (except ``max_body_bytes``, always set)."""

    rps: float = 0.0
    rpm: int = 0
    tpm: int = 0
    max_prompt_tokens: int = 0
    max_tokens: int = 0
    max_body_bytes: int = 1_000_000
    queue_budget_s: float = 0.0
    tokens_per_day: int = 0
    tokens_per_month: int = 0

    def default_deadline(self, now: datetime) -> datetime | None:
        """``now`` plus the queue budget, or None without one."""
        return now + timedelta(seconds=self.queue_budget_s) if self.queue_budget_s > 0 else None


def _text_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", errors="replace")) / BYTES_PER_TOKEN)


def estimate_prompt_tokens(body: AnyBody) -> int:
    """The prompt's size in tokens: exact for token ids, estimated from UTF-8 bytes for text and messages."""
    if isinstance(body, ChatCompletionBody):
        messages = body.messages
    elif isinstance(body, (CompletionBody, EmbeddingInput)):
        prompt = body.prompt
        return len(prompt) if isinstance(prompt, list) else _text_tokens(str(prompt))
    elif body.messages is not None:
        messages = body.messages
    else:
        prompt = body.prompt
        return len(prompt) if isinstance(prompt, list) else _text_tokens(prompt or "")
    total = 0
    for message in messages:
        content = message.content or ""
        if not isinstance(content, str):
            content = "".join(part.text or "" for part in content)
        calls = "".join(c.function.name + c.function.arguments for c in message.tool_calls or [])
        total += TOKENS_PER_MESSAGE + _text_tokens(content + calls)
    tools = getattr(body, "tools", None)
    if tools:  # rendered into the prompt by the chat template
        total += _text_tokens("".join(t.model_dump_json() for t in tools))
    return total


def estimate_request_tokens(request: InferenceRequest) -> int:
    """A pipeline request's prompt size, estimated as :func:`estimate_prompt_tokens` estimates a body's (for
    Kafka-native records and batch lines, whose bodies are no longer at hand)."""
    if request.messages is None:
        prompt = request.prompt
        return len(prompt) if isinstance(prompt, list) else _text_tokens(prompt or "")
    total = 0
    for message in request.messages:
        calls = "".join(c.function.name + c.function.arguments for c in message.tool_calls or [])
        total += TOKENS_PER_MESSAGE + _text_tokens(message.text() + calls)
    if request.tools:
        total += _text_tokens("".join(t.model_dump_json() for t in request.tools))
    return total


def request_token_cost(request: InferenceRequest) -> int:
    """What a request may cost in tokens before it runs: its prompt (estimated) and every token it may generate.
    The worker's intake charges a start this, and the router a tenant's share of a worker."""
    return estimate_request_tokens(request) + request.sampling.max_tokens * request.sampling.n


def _explicit_max_tokens(body: AnyBody) -> bool:
    return bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)


def checked_max_tokens(body: AnyBody, limits: Limits) -> int:
    """The request's ``max_tokens`` under the key's cap: a default above the cap is lowered to it, an explicit
    value above it is a 400 (the client asked for something it cannot have)."""
    wanted = body.resolved_max_tokens()
    if not limits.max_tokens or wanted <= limits.max_tokens:
        return wanted
    if not _explicit_max_tokens(body):
        return limits.max_tokens
    field = "max_completion_tokens" if "max_completion_tokens" in body.model_fields_set else "max_tokens"
    raise ApiError(
        400,
        f"'{field}' is {wanted}, above this API key's limit of {limits.max_tokens} tokens.",
        code="max_tokens_exceeded",
        param=field,
    )


def model_context(heartbeats: Iterable[WorkerHeartbeat]) -> int | None:
    """The model's context length as its workers report it (the smallest, should they differ)."""
    lengths = [b.max_model_len for b in heartbeats if b.max_model_len]
    return min(lengths) if lengths else None


def check_context(body: AnyBody, max_tokens: int, context: int | None) -> int:
    """``max_tokens`` within the model's ``context`` (None: not known): a default above it is lowered to it, an
    explicit value above it is a 400 naming the parameter (the request could never finish as asked)."""
    if context is None or max_tokens <= context:
        return max_tokens
    field = "max_completion_tokens" if "max_completion_tokens" in body.model_fields_set else "max_tokens"
    if field not in body.model_fields_set:
        return context
    raise ApiError(
        400,
        f"'{field}' is {max_tokens}, more than the model's context length of {context} tokens.",
        code="context_length_exceeded",
        param=field,
    )


def check_prompt_tokens(body: AnyBody, limits: Limits) -> int:
    """The prompt's estimated tokens; a 400 when it is over the key's limit."""
    tokens = estimate_prompt_tokens(body)
    if limits.max_prompt_tokens and tokens > limits.max_prompt_tokens:
        field = "prompt" if getattr(body, "prompt", None) is not None else "messages"
        how = "token ids" if isinstance(getattr(body, "prompt", None), list) else "estimated tokens (UTF-8 bytes / 4)"
        raise ApiError(
            400,
            f"The prompt is {tokens} {how}, above this API key's limit of {limits.max_prompt_tokens}.",
            code="prompt_too_long",
            param=field,
        )
    return tokens


def check_rate_cost(tokens: int, limits: Limits) -> None:
    """A request that alone needs more tokens than the key's per-minute budget can never pass: 400, not a 429
    that would be retried forever."""
    if limits.tpm and tokens > limits.tpm:
        raise ApiError(
            400,
            f"The request needs {tokens} tokens (prompt estimate + max_tokens), above this API key's limit of "
            f"{limits.tpm} tokens per minute; lower max_tokens or shorten the prompt.",
            code="rate_limit_cost_exceeded",
            param="max_tokens",
        )
