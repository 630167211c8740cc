"""``LLM.score``: teacher-forced logits of every position through the engine's own model and KV cache equal
transformers' full forward (fp32), whether the sequence runs as one prefill or as a prompt then decode steps or
chunks; an
FP8 cache reads earlier tokens back quantized (close, not equal); the borrowed blocks all come back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_workers.engine import LLM


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_score_equals_the_transformers_forward(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    path = model_dir("llama3_tied")
    ids = _ids(100, seed=5)  # 7 blocks
    llm = make_llm(path, dtype="float32")
    expected = _hf_logits(path, ids)
    whole = llm.score(ids)
    assert whole.shape == (len(ids), llm.engine.vocab_size) and whole.dtype == torch.float32
    torch.testing.assert_close(whole, expected, atol=2e-4, rtol=1e-4)
    stepped = llm.score(ids, prefill_len=17)  # a prompt off a block boundary, then 83 decode steps
    torch.testing.assert_close(stepped, expected, atol=2e-4, rtol=1e-4)
    chunked = llm.score(ids, prefill_len=17, step_len=16)  # then chunks of 16 and a last one of 3
    torch.testing.assert_close(chunked, expected, atol=2e-4, rtol=1e-4)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    # Nothing of it lands in the prefix cache: the next request computes its whole prompt.
    assert llm.engine.block_manager.num_cached_blocks == 0


def test_fp8_cache_reads_earlier_tokens_back_quantized(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    ids = _ids(96, seed=7)
    exact = make_llm(path, dtype="float32").score(ids)
    fp8 = make_llm(path, dtype="float32", kv_cache_dtype="fp8")
    prefill = fp8.score(ids)  # one prefill attends its fresh K/V: no cache read at all
    torch.testing.assert_close(prefill, exact, atol=2e-4, rtol=1e-4)
    decoded = fp8.score(ids, prefill_len=8)
    torch.testing.assert_close(decoded[:8], exact[:8], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(decoded[8:], exact[8:], atol=1e-4)
    assert (decoded[8:].argmax(-1) == exact[8:].argmax(-1)).float().mean() > 0.9
    # Chunks read their own tokens back from the cache too: the same quantized K/V as decode steps.
    torch.testing.assert_close(fp8.score(ids, prefill_len=8, step_len=32), decoded, atol=2e-4, rtol=1e-4)


def test_score_refuses_a_busy_engine_and_bad_lengths(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("llama"), dtype="float32")
    with pytest.raises(ValueError, match="prefill_len"):
        llm.score([5, 6, 7], prefill_len=4)
    with pytest.raises(ValueError, match="prefill_len"):
        llm.score([5, 6, 7], prefill_len=0)
    with pytest.raises(ValueError, match="step_len"):
        llm.score([5, 6, 7], prefill_len=1, step_len=0)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    llm.engine.add_request([5, 6, 7])
    with pytest.raises(RuntimeError, match="idle"):
        llm.score([5, 6, 7])
    llm.engine.abort_all()
