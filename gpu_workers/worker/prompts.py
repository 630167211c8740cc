"""Turning a contract-level request into what the engine takes: prompt token ids and sampling params."""

from __future__ import annotations

from typing import Any

from gpu_workers.engine import SamplingParams
from schemas import InferenceRequest


class PromptError(ValueError):
    """The request cannot be turned into a prompt for this model (reported as an ``error`` event)."""


def prompt_token_ids(request: InferenceRequest, tokenizer: Any) -> list[int]:
    """Token ids of the request's prompt; chat messages go through the model's chat template."""
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(f"model {request.model!r} has no chat template; send 'prompt' instead")
        conversation = [{"role": m.role, "content": m.text()} for m in request.messages]
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding-like mapping for some tokenizers.
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        return [int(i) for i in ids]
    if isinstance(request.prompt, str):
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))
    vocab = len(tokenizer)
    bad = [t for t in request.prompt or [] if t >= vocab]
    if bad:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab})")
    return list(request.prompt or [])


def sampling_params(request: InferenceRequest, already_generated: int = 0) -> SamplingParams:
    """Engine sampling params; a resumed request only generates what is still owed."""
    opts = request.sampling
    return SamplingParams(
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k or 0,
        max_tokens=max(1, opts.max_tokens - already_generated),
        stop=list(opts.stop),
        stop_token_ids=list(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        seed=opts.seed,
    )
