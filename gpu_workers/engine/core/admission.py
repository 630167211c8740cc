"""Admission: check a request against the model and tokenize its prompt, before it reaches the step loop.

The check needs only the tokenizer and the model's limits, so it runs wherever the request arrives (the event
loop of ``AsyncEngine`` or of ``ProcessEngine``'s front) and a request that can never run is refused at once.
An admitted ``EngineRequest`` carries its prompt's token ids: it crosses a process boundary as it is, and the
engine turns it into a ``Sequence`` without tokenizing again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..sampling_params import SamplingParams
from .request import EngineRequest


def max_output_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """Tokens a request may generate: ``params.max_tokens``, or what the context leaves when that is None."""
    if params.max_tokens is None:
        return max_model_len - num_prompt_tokens
    return params.max_tokens


class RequestValidator:
    """Validates and tokenizes requests against one model's tokenizer, vocabulary and context length."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        enable_lora: bool = False,
        refused_tokens: dict[int, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        # Prompt tokens the model cannot serve (an image placeholder without a vision tower), with the reason.
        self.refused_tokens = dict(refused_tokens or {})

    def admit(self, request: EngineRequest) -> EngineRequest:
        """The request with its prompt's token ids; ``ValueError`` naming the problem for one that can never run."""
        if request.lora_request is not None and not self.enable_lora:
            raise ValueError(
                f"request names LoRA adapter {request.lora_request.lora_name!r}, but the engine was built without "
                "enable_lora=True"
            )
        prompt = request.prompt
        if isinstance(prompt, str):
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
        refused = next((t for t in token_ids if t in self.refused_tokens), None) if self.refused_tokens else None
        if refused is not None:
            raise ValueError(f"prompt token {refused}: {self.refused_tokens[refused]}")
        n = len(token_ids)
        if request.pooling is not None:
            # Prefill only: the prompt may fill the context, and no output tokens are checked.
            if n > self.max_model_len:
                raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}")
            return replace(request, prompt_token_ids=token_ids)
        if request.params.max_tokens is None:
            if max_output_tokens(n, request.params, self.max_model_len) < 1:
                raise ValueError(f"prompt has {n} tokens, leaving no room under max_model_len={self.max_model_len}")
        elif n + request.params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}"
            )
        params = request.params
        out_of_vocab = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if params.guided is not None:
            out_of_vocab += [t for t in params.guided.replay_token_ids if t >= self.vocab_size]
        if out_of_vocab:
            raise ValueError(
                f"token ids out of range [0, {self.vocab_size}) in logit_bias or replay: {out_of_vocab[:5]}"
            )
        # The engine guarantees its cache holds max_model_len tokens, so a request that passes the check
        # above always fits once it has the pool to itself.
        return replace(request, prompt_token_ids=token_ids)
