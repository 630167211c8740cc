"""The engine on the Triton attention backend produces transformers' greedy tokens, with prefix
hits read from the paged cache, mixed and decode batches, cascade attention over a shared prefix,
and the padded static-buffer decode path that CUDA graphs replay.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton), which is slow: prompts stay short and few.
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports below follow require_import (tests/needs.py), a CI-aware importorskip
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from needs import require_import

require_import("triton", "a dependency of torch; pip install -e '.[dev]'")

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.attention import triton_backend
from gpu_workers.engine.attention.triton_kernels import INTERPRETED

from .conftest import HFReference

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not HAS_CUDA and not INTERPRETED, reason="needs CUDA or TRITON_INTERPRET=1 before triton's first import"
)
DEVICE = "cuda" if HAS_CUDA else "cpu"
BLOCK = 16


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompts(seed: int, prefix_len: int, suffix_lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in suffix_lens]


def _triton_llm(make_llm: Callable[..., LLM], path: Path, **kwargs: Any) -> LLM:
    # fp32 so the comparison with transformers' fp32 reference is exact.
    kwargs.setdefault("num_kv_blocks", 64)
    llm = make_llm(path, attention_backend="triton", device=DEVICE, dtype="float32", **kwargs)
    assert llm.engine.attention_backend_name == "triton"
    return llm


def _count_cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the backend's cascade launches (the real kernels still run)."""
    calls: list[int] = []
    real = triton_backend.cascade_paged_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "cascade_paged_attention", counting)
    return calls


@pytest.mark.parametrize("variant", ["llama", "qwen3", "phi4mini"])
def test_matches_transformers_with_prefix_hits_and_decode_batches(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    llm = _triton_llm(make_llm, path, enforce_eager=True)
    # A fresh mixed batch: two prompts share 40 tokens (2.5 blocks), one is a single token.
    first = [*_prompts(1, 40, [3, 9]), [7]]
    # Then prefix hits: the same 40-token start (two whole cached blocks) and an exact repeat.
    second = [*_prompts(1, 40, [5]), first[1]]
    for prompts, max_tokens in ((first, [5, 3, 4]), (second, [4, 5])):
        outputs = llm.generate(prompts, [_greedy(n) for n in max_tokens])
        for out, prompt, n in zip(outputs, prompts, max_tokens, strict=True):
            assert out.token_ids == hf_reference.greedy(path, prompt, n), f"{len(prompt)}-token prompt diverged"
    assert outputs[0].num_cached_tokens == 2 * BLOCK
    assert outputs[1].num_cached_tokens == 3 * BLOCK  # the repeat's whole blocks; its last token is recomputed


def test_cascade_decode_gives_the_same_tokens(
    model_dir: Callable[[str], Path],
    hf_reference: HFReference,
    make_llm: Callable[..., LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = model_dir("llama")
    # Three requests on a 48-token (three-block) prefix; a warm-up request puts the prefix in the
    # cache first, so all three then share its physical blocks while they decode together.
    prompts = _prompts(2, 48, [2, 6, 11])
    warm = prompts[0][:49]
    results = {}
    for cascade in (False, True):
        calls = _count_cascade_calls(monkeypatch)
        llm = _triton_llm(make_llm, path, enforce_eager=True, enable_cascade_attention=cascade)
        assert llm.engine.runner.use_cascade is cascade
        # The tiny test batch and prefix are far below the thresholds that pay off on a GPU.
        llm.engine.runner.cascade_min_prefix_len = BLOCK
        llm.engine.runner.cascade_min_seqs = 2
        llm.generate([warm], _greedy(1))
        outputs = llm.generate(prompts, _greedy(4))
        results[cascade] = [o.token_ids for o in outputs]
        assert all(o.num_cached_tokens == 48 for o in outputs)
        # Two layers per step; three decode steps of the batch share the prefix.
        assert (len(calls) > 0) is cascade, f"cascade={cascade} but {len(calls)} cascade launches"
    assert results[True] == results[False]
    assert results[True] == [hf_reference.greedy(path, p, 4) for p in prompts]


def test_padded_static_decode_path_matches_transformers(
    model_dir: Callable[[str], Path],
    hf_reference: HFReference,
    make_llm: Callable[..., LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a CUDA graph replays, run eagerly: 3 sequences padded to the 4-row bucket (a padding
    # row stores nothing and reads block 0), cascade through the device-side prefix length.
    path = model_dir("llama")
    calls = _count_cascade_calls(monkeypatch)
    llm = _triton_llm(make_llm, path, enforce_eager=True)
    runner = llm.engine.runner
    runner.cascade_min_prefix_len = BLOCK
    runner.cascade_min_seqs = 2
    runner.enable_decode_graphs(max_num_seqs=8, max_model_len=llm.engine.max_model_len, capture=False)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    prompts = _prompts(3, 32, [1, 4, 7])
    llm.generate([prompts[0][:33]], _greedy(1))
    outputs = llm.generate(prompts, _greedy(4))
    assert [o.token_ids for o in outputs] == [hf_reference.greedy(path, p, 4) for p in prompts]
    assert calls, "the padded decode batches should have taken the cascade path"
    assert graphs.num_replays == 0  # nothing was captured on this path


@pytest.mark.parametrize("variant", ["mistral_sliding", "gemma3"])
def test_sliding_window_with_released_blocks_matches_transformers(
    variant: str, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    # Prompts well past the 48-token window, prefilled in 32-token chunks, then a prefix hit on the
    # first one: the kernels must mask each sliding layer to its window and skip released blocks.
    path = model_dir(variant)
    llm = _triton_llm(make_llm, path, enforce_eager=True, max_num_batched_tokens=32)
    prompts = _prompts(4, 96, [1, 30])
    released: list[int] = []
    real_release = llm.engine.block_manager.release_out_of_window

    def counting(seq: Any) -> int:
        released.append(real_release(seq))
        return released[-1]

    llm.engine.block_manager.release_out_of_window = counting  # type: ignore[method-assign]
    for batch in ([prompts[0]], prompts):
        outputs = llm.generate(batch, _greedy(4))
        for out, prompt in zip(outputs, batch, strict=True):
            assert out.token_ids == hf_reference.greedy(path, prompt, 4), f"{len(prompt)}-token prompt diverged"
    # Mistral slides in every layer and gives blocks back; Gemma 3's sliding group does too (the hybrid cache), while
    # its global group keeps them all.
    assert sum(released) > 0
    assert outputs[1].num_cached_tokens == 96
