"""Turning a contract-level request into what the engine takes (prompt token ids, sampling params with the
grammar), and the engine's per-token logprobs back into the contract's shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_workers.engine import GuidedDecoding, SamplingParams
from gpu_workers.engine import TokenLogprob as EngineLogprob
from gpu_workers.engine.token_bytes import TokenBytes
from schemas import InferenceRequest, ReasoningParser, TokenLogprob, ToolCallFormat, TopLogprob
from sluicegate.chat_template import template_message


class PromptError(ValueError):
    """The request cannot be turned into a prompt for this model (reported as an ``error`` event)."""


def prompt_token_ids(request: InferenceRequest, tokenizer: Any) -> list[int]:
    """Token ids of the request's prompt; chat messages (tool calls and results included), the offered tools and
    the request's ``chat_template_kwargs`` go through the model's chat template."""
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(f"model {request.model!r} has no chat template; send 'prompt' instead")
        conversation = [template_message(m) for m in request.messages]
        tools = [t.model_dump(mode="json", exclude_none=True) for t in request.tools] if request.tools else None
        try:
            ids = tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as exc:  # a template's own raise_exception, or a message shape it cannot render
            raise PromptError(f"the model's chat template cannot render these messages: {exc}") from exc
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


def prompt_len_or_zero(request: InferenceRequest, tokenizer: Any) -> int:
    """The prompt's length in tokens, or 0 for one that cannot be rendered (usage of a request never run)."""
    try:
        return len(prompt_token_ids(request, tokenizer))
    except PromptError:
        return 0


def tool_call_format(tokenizer: Any) -> ToolCallFormat | None:
    """How the model writes tool calls, read from its chat template (advertised in heartbeats)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return "llama3_json"
    return None


def reasoning_parser(tokenizer: Any, setting: str = "auto") -> ReasoningParser | None:
    """How the model's chat output splits into reasoning and answer (advertised in heartbeats): the setting's
    parser, or for ``auto`` qwen3's when the chat template knows the ``</think>`` that ends a reasoning span."""
    if setting == "none":
        return None
    if setting in ("qwen3", "deepseek_r1"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(f"reasoning parser {setting!r} is not one of auto, none, qwen3, deepseek_r1")
    template = getattr(tokenizer, "chat_template", None)
    return "qwen3" if isinstance(template, str) and "</think>" in template else None


def sampling_params(
    request: InferenceRequest, already_generated: int = 0, delivered: list[int] | None = None
) -> SamplingParams:
    """Engine sampling params; a resumed request only generates what is still owed, and its grammar first
    replays the ``delivered`` tokens so the output stays valid across the crash."""
    opts = request.sampling
    guided = None
    if request.guided is not None:
        spec = request.guided
        guided = GuidedDecoding(
            json_schema=spec.json_schema,
            json_object=spec.json_object,
            regex=spec.regex,
            choice=list(spec.choice) if spec.choice else None,
            grammar=spec.grammar,
            replay_token_ids=list(delivered or []),
        )
    return SamplingParams(
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k or 0,
        max_tokens=max(1, opts.max_tokens - already_generated),
        stop=list(opts.stop),
        stop_token_ids=list(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        seed=opts.seed,
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        repetition_penalty=opts.repetition_penalty,
        min_p=opts.min_p,
        logit_bias={int(k): v for k, v in opts.logit_bias.items()} if opts.logit_bias else None,
        logprobs=opts.logprobs,
        n=opts.n,
        guided=guided,
    )


class LogprobText:
    """Token strings for logprobs (each id decoded on its own, as vLLM does), cached per token id, and each
    token's raw bytes."""

    def __init__(self, tokenizer: Any, token_bytes: Callable[[int], bytes] | None = None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes = token_bytes  # built from the tokenizer on first use unless given

    def raw(self, token_id: int) -> list[int]:
        """The token's own bytes (a partial UTF-8 character stays itself, not U+FFFD's)."""
        if self._bytes is None:
            self._bytes = TokenBytes(self._tokenizer)
        return list(self._bytes(token_id))

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def convert(self, logprobs: list[EngineLogprob] | None) -> list[TokenLogprob] | None:
        """The contract's logprobs for an engine delta's."""
        if logprobs is None:
            return None
        return [
            TokenLogprob(
                token_id=lp.token_id,
                token=self.token(lp.token_id),
                logprob=_finite(lp.logprob),
                bytes=self.raw(lp.token_id),
                top=[
                    TopLogprob(token_id=t, token=self.token(t), logprob=_finite(v), bytes=self.raw(t))
                    for t, v in lp.top
                ],
            )
            for lp in logprobs
        ]


def _finite(value: float) -> float:
    # JSON has no -inf; a token masked out entirely reads as a very unlikely one.
    return max(float(value), -9999.0)
