"""Admission checks: turn a prompt and its sampling params into a validated, tokenized ``EngineRequest``.

The check needs only the tokenizer and the model's limits, so it runs wherever the request arrives (the
event loop of ``AsyncEngine`` or of ``ProcessEngine``'s front) and a request that can never run is refused
at once, before it reaches the step loop. An ``EngineRequest`` is plain data: it crosses a process boundary
as it is, and the engine turns it into a ``Sequence``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..sampling_params import SamplingParams

PromptInput = str | list[int]


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed admission: everything the engine needs to schedule it."""

    request_id: str
    prompt: str | None  # the text, when the request came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # scheduling tier: lower runs first
    tenant: str
    arrival_time: float  # ``time.time()`` when the request was admitted
    max_tokens: int  # ``params.max_tokens``, or what the context leaves when that is None


def check_priority(priority: object) -> None:
    """A priority is a plain int (lower runs first); anything else - a tier name, a bool - is refused."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"unknown priority {priority!r}: a priority is an int, lower runs first")


class RequestValidator:
    """Validates and tokenizes requests against one model's tokenizer, vocabulary and context length."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def validate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str = "default",
    ) -> EngineRequest:
        """The admitted request; ``ValueError`` naming the problem for one that can never run."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
            token_ids = list(self.tokenizer(prompt).input_ids)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        else:
            raise ValueError("a prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        n = len(token_ids)
        if params.max_tokens is None:
            max_tokens = self.max_model_len - n
            if max_tokens < 1:
                raise ValueError(f"prompt has {n} tokens, leaving no room under max_model_len={self.max_model_len}")
        else:
            max_tokens = params.max_tokens
            if n + max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_model_len={self.max_model_len}"
                )
        # The engine guarantees its cache holds max_model_len tokens, so a request that passes the check
        # above always fits once it has the pool to itself.
        return EngineRequest(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            priority=priority,
            tenant=tenant,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            max_tokens=max_tokens,
        )
