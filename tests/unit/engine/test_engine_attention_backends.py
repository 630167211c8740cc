"""Choosing an attention backend: flash-attn's block-size rule and its errors when it cannot run,
``auto`` falling back, and the engine refusing an impossible request before loading weights."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_workers.engine import LLM, EngineConfig
from gpu_workers.engine.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend
from gpu_workers.engine.attention.flash_attn_backend import FLASH_ATTN_BLOCK_MULTIPLE, flash_attn_block_size_problem

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def test_flash_attn_block_size_rule() -> None:
    assert FLASH_ATTN_BLOCK_MULTIPLE == 256
    assert flash_attn_block_size_problem(256) is None
    assert flash_attn_block_size_problem(512) is None
    for bad in (16, 128, 320):
        problem = flash_attn_block_size_problem(bad)
        assert problem is not None
        assert f"multiple of 256 (got {bad})" in problem and "block_size=256" in problem and "triton" in problem


def test_engine_config_rejects_flash_attn_with_small_blocks(model_dir: Callable[[str], Path]) -> None:
    path = str(model_dir("llama"))
    with pytest.raises(ValueError, match=r"multiple of 256 \(got 16\)"):
        EngineConfig(model=path, attention_backend="flash_attn", block_size=16)
    EngineConfig(model=path, attention_backend="flash_attn", block_size=256)  # valid as configuration


@pytest.mark.skipif(torch.cuda.is_available() and HAS_FLASH_ATTN, reason="flash_attn can run here")
def test_flash_attn_asked_for_explicitly_says_every_reason_it_cannot_run(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="attention backend 'flash_attn' is unavailable") as info:
        get_attention_backend("flash_attn", "cpu", block_size=16, dtype=torch.float32)
    message = str(info.value)
    assert "needs a CUDA device" in message
    assert "multiple of 256 (got 16)" in message
    assert "float16/bfloat16" in message
    if not HAS_FLASH_ATTN:
        assert "flash_attn package is not installed (pip install flash-attn)" in message
    # Through the engine, with a valid block size: the device/package problem, before any forward.
    with pytest.raises(ValueError, match="flash_attn"):
        LLM(str(model_dir("llama")), attention_backend="flash_attn", block_size=256, num_kv_blocks=8)


def test_auto_falls_back_without_flash_attn_blocks() -> None:
    # On CPU auto is the reference backend whatever the block size.
    assert isinstance(get_attention_backend("auto", "cpu", block_size=256, dtype=torch.bfloat16), TorchAttentionBackend)
    if torch.cuda.is_available():
        # Blocks of 16 never suit flash-attn's paged kernel: auto takes the Triton kernel.
        assert get_attention_backend("auto", "cuda", block_size=16, dtype=torch.bfloat16).name == "triton"


def _paged_batch(
    seqs: list[tuple[int, int]], block_size: int, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q/k/v rows for ``(seq_len, q_len)`` sequences whose earlier context is already in a random
    paged bf16 cache (shuffled block ids), plus the metadata of that step."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 8, 2, 128
    blocks_per_seq = [-(-n // block_size) for n, _ in seqs]
    order = torch.randperm(sum(blocks_per_seq) + 2, generator=gen).tolist()
    k_cache = torch.randn(len(order), block_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(len(order), block_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    slots, starts = [], [0]
    for i, ((seq_len, q_len), count) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        blocks = [order.pop() for _ in range(count)]
        tables[i, :count] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    n = starts[-1]
    q = torch.randn(n, heads, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(n, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q_lens = [q_len for _, q_len in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s for s, _ in seqs),
        is_decode_only=max(q_lens) == 1,
        query_start_loc_cpu=starts,
        seq_lens_cpu=[s for s, _ in seqs],
    )
    return q.to(device), k.to(device), v.to(device), k_cache.to(device), v_cache.to(device), meta


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLASH_ATTN), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([(300, 300), (700, 45), (257, 1), (1000, 1)], id="prefill-prefix-hit-and-decode"),
        pytest.param([(1, 1), (300, 1), (513, 1), (2000, 1)], id="decode-only"),
    ],
)
def test_flash_attn_backend_matches_triton(seqs: list[tuple[int, int]]) -> None:
    from gpu_workers.engine.attention.triton_backend import TritonAttentionBackend

    flash = get_attention_backend("flash_attn", "cuda", block_size=256, dtype=torch.bfloat16)
    triton_backend = TritonAttentionBackend()
    outputs = []
    for backend in (flash, triton_backend):
        q, k, v, k_cache, v_cache, meta = _paged_batch(seqs, block_size=256, device="cuda")
        outputs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 128**-0.5).float())
    assert (outputs[0] - outputs[1]).abs().max().item() < 2e-2
