"""Greedy engine output equals transformers ``generate`` token for token (fp32, CPU), for every
supported architecture and under every scheduling regime: all at once, staggered arrivals,
preemption under a tiny KV cache, shared prefixes served from the prefix cache, chunked prefill."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, RequestOutput, SamplingParams

from .conftest import MODEL_VARIANTS, HFReference, random_prompts, shared_prefix_prompts

VARIANTS = list(MODEL_VARIANTS)
Prompts = list[tuple[list[int], int]]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _check(outputs: list[RequestOutput], prompts: Prompts, path: Path, hf: HFReference) -> None:
    assert len(outputs) == len(prompts)
    for i, (out, (prompt, max_tokens)) in enumerate(zip(outputs, prompts, strict=True)):
        assert out.prompt_token_ids == prompt
        expected = hf.greedy(path, prompt, max_tokens)
        assert out.token_ids == expected, f"prompt {i} ({len(prompt)} tokens) diverged from transformers"
        assert out.finish_reason == "length"


def _seed(variant: str) -> int:
    """A seed of the variant's own, so adding a variant does not change the others' prompts."""
    return zlib.crc32(variant.encode()) % 1000


def _prompts_for(variant: str) -> Prompts:
    return random_prompts(seed=_seed(variant))


def _generate(llm: LLM, prompts: Prompts) -> list[RequestOutput]:
    return llm.generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_at_once(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    prompts = _prompts_for(variant)
    llm = make_llm(path)
    outputs = _generate(llm, prompts)
    _check(outputs, prompts, path, hf_reference)
    # Varied output, so the comparison is meaningful (not one token repeated).
    longest = max(outputs, key=lambda o: len(o.token_ids))
    assert len(set(longest.token_ids)) > 8


@pytest.mark.parametrize("variant", VARIANTS)
def test_staggered_arrivals(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    prompts = _prompts_for(variant)
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=256)
    engine = llm.engine
    finals: dict[str, RequestOutput] = {}
    ids: list[str] = []
    pending = list(prompts)
    while pending or engine.has_unfinished():
        # A few new requests join between steps while others are mid-prefill or decoding.
        for prompt, max_tokens in pending[:3]:
            ids.append(engine.add_request(prompt, _greedy(max_tokens)))
        pending = pending[3:]
        for _ in range(2):
            for delta in engine.step():
                if delta.final is not None:
                    finals[delta.request_id] = delta.final
    _check([finals[i] for i in ids], prompts, path, hf_reference)


@pytest.mark.parametrize("variant", VARIANTS)
def test_preemption_under_small_kv_cache(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    prompts = _prompts_for(variant)
    # 32 blocks x 16 = 512 slots (max_model_len): one longest request fits, all of them together need ~3000.
    llm = make_llm(path, num_kv_blocks=32)
    outputs = _generate(llm, prompts)
    _check(outputs, prompts, path, hf_reference)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions > 0 for o in outputs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shared_prefixes_hit_the_prefix_cache(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    prompts = shared_prefix_prompts(seed=100 + _seed(variant))
    llm = make_llm(path, max_num_batched_tokens=512)
    # The first two requests warm the cache; the rest (one step at a time budget-wise) reuse it.
    first = _generate(llm, prompts[:2])
    rest = _generate(llm, prompts[2:])
    _check(first + rest, prompts, path, hf_reference)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert 0.0 < stats.prefix_cache_hit_rate < 1.0
    assert all(o.num_cached_tokens > 0 for o in rest)
    # A hit never covers the last prompt token, even for a block-aligned prompt equal to a prefix.
    for out in rest:
        assert out.num_cached_tokens <= len(out.prompt_token_ids) - 1
        assert out.num_cached_tokens % 16 == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    prompts = _prompts_for(variant)
    llm = make_llm(path, max_num_batched_tokens=40, enable_prefix_caching=False)
    outputs = _generate(llm, prompts)
    _check(outputs, prompts, path, hf_reference)
    assert llm.engine.scheduler.num_chunked_prefill_steps > 0


def test_text_prompts_match_transformers(
    model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    llm = make_llm(path)
    texts = ["The river ran quietly", "A message queue carries requests", "Numbers like 2026"]
    outputs = llm.generate(texts, _greedy(12))
    for text, out in zip(texts, outputs, strict=True):
        prompt = llm.tokenizer(text).input_ids
        assert out.prompt == text
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_reference.greedy(path, prompt, 12)
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
