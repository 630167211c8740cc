"""Checks the Triton paged-attention kernels against a dense float64 attention written here.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter (see
conftest.py); the ``cuda`` variants run the same cases compiled on a GPU. Every case builds its
ground truth as dense per-sequence K/V, scatters it into a NaN-filled paged cache through random,
non-contiguous block tables, and compares the kernels' output with attention computed from the
dense tensors, so a kernel that reads a wrong slot, an unwritten slot or a future position fails.
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports below follow require_import (tests/needs.py), a CI-aware importorskip
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from needs import require_import

require_import("triton", "a dependency of torch; pip install -e '.[dev]'")

from gpu_workers.engine.attention import triton_kernels as tk
from gpu_workers.engine.attention.metadata import AttentionMetadata
from gpu_workers.engine.attention.triton_backend import TritonAttentionBackend

HAS_CUDA = torch.cuda.is_available()
# Without CUDA the checks need the interpreter. If triton was imported before conftest.py could set
# TRITON_INTERPRET (importing gpu_workers.engine does, through torch._dynamo, and so does
# bitsandbytes), this process cannot interpret the kernels, and
# test_cpu_checks_in_fresh_interpreter_process runs this file in a new process instead.
NEEDS_FRESH_PROCESS = not HAS_CUDA and not tk.INTERPRETED
_FRESH_PROCESS_FLAG = "SLUICEGATE_TRITON_TEST_FRESH_PROCESS"
if NEEDS_FRESH_PROCESS and os.environ.get(_FRESH_PROCESS_FLAG) == "1":
    raise RuntimeError("TRITON_INTERPRET=1 was set for this fresh process, yet the kernels are not interpreted")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not tk.INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton's import"),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not HAS_CUDA or tk.INTERPRETED, reason="needs CUDA with compiled Triton"),
        ],
    ),
]

# Max abs error against the float64 reference, per input dtype. fp32 runs its dots in IEEE fp32;
# fp16/bf16 round P to the input dtype before P @ V and round the output once.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Batch:
    """One step's inputs plus the dense ground truth they were built from."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    q_lens: list[int]
    num_real_tokens: int


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    num_pad_tokens: int = 0,
    shared_prefix_blocks: int = 0,
    strided_q: bool = False,
    seed: int = 0,
) -> Batch:
    """``seqs`` lists ``(seq_len, q_len)``: the last ``q_len`` tokens are this step's queries, the
    rest is already cached. ``num_pad_tokens`` extra flat rows with slot -1 follow the real ones
    (a padded CUDA-graph batch). ``shared_prefix_blocks`` makes every sequence start with the same
    physical blocks holding the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    shared = shared_prefix_blocks
    num_blocks = shared + sum(n - shared for n in blocks_needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    prefix_blocks = [pool.pop() for _ in range(shared)]
    prefix_k = torch.randn(shared * block_size, num_kv_heads, head_dim, generator=gen)
    prefix_v = torch.randn(shared * block_size, num_kv_heads, head_dim, generator=gen)

    # NaN everywhere that no sequence owns: reading a wrong slot poisons the result.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.zeros(len(seqs), max(blocks_needed) + 2, dtype=torch.int32)
    keys, values, queries, k_new, v_new, slots, starts = [], [], [], [], [], [], [0]
    for i, (seq_len, q_len) in enumerate(seqs):
        assert 1 <= q_len <= seq_len
        blocks = prefix_blocks + [pool.pop() for _ in range(blocks_needed[i] - shared)]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        n_shared = min(seq_len, shared * block_size)
        k[:n_shared], v[:n_shared] = prefix_k[:n_shared], prefix_v[:n_shared]
        k, v = k.to(dtype), v.to(dtype)
        seq_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        context = seq_len - q_len
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:context]] = k[:context]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:context]] = v[:context]
        keys.append(k)
        values.append(v)
        k_new.append(k[context:])
        v_new.append(v[context:])
        slots.append(seq_slots[context:])
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        starts.append(starts[-1] + q_len)

    num_real = starts[-1]
    pad = num_pad_tokens
    q = torch.cat([*queries, torch.randn(pad, num_heads, head_dim, generator=gen).to(dtype)])
    k_rows = torch.cat([*k_new, torch.randn(pad, num_kv_heads, head_dim, generator=gen).to(dtype)])
    v_rows = torch.cat([*v_new, torch.randn(pad, num_kv_heads, head_dim, generator=gen).to(dtype)])
    slot_mapping = torch.cat([*slots, torch.full((pad,), -1, dtype=torch.long)])
    q = q.to(device)
    if strided_q:
        # q as a view into a fused qkv projection output: token stride larger than heads * dim.
        fused = torch.zeros(q.shape[0], num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
        fused[:, :num_heads] = q
        q = fused[:, :num_heads]
    q_lens = [q_len for _, q_len in seqs]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s for s, _ in seqs),
        is_decode_only=all(n == 1 for n in q_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[s for s, _ in seqs],
    )
    return Batch(
        q=q,
        k_new=k_rows.to(device),
        v_new=v_rows.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        keys=keys,
        values=values,
        q_lens=q_lens,
        num_real_tokens=num_real,
    )


def dense_attention(batch: Batch, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal softmax attention per sequence in float64 from the dense ground truth (query position
    ``p`` sees keys ``p - window < k <= p`` with a window, as transformers masks sliding layers)."""
    outputs = []
    q_all = batch.q.detach().cpu().double()
    start = 0
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens, strict=True):
        seq_len = k.shape[0]
        group = q_all.shape[1] // k.shape[1]
        q = q_all[start : start + q_len]
        k64 = k.double().repeat_interleave(group, dim=1)
        v64 = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k64) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v64))
        start += q_len
    return torch.cat(outputs)


def assert_close_to_reference(
    out: torch.Tensor, batch: Batch, scale: float, dtype: torch.dtype, window: int | None = None
) -> None:
    expected = dense_attention(batch, scale, window)
    got = out[: batch.num_real_tokens].detach().cpu().double()
    assert torch.isfinite(got).all()
    err = (got - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} > {TOLERANCE[dtype]:.1g}"


# (block_size, num_heads, num_kv_heads, head_dim, dtype): block sizes 16/32/256 plus a
# non-power-of-two one, GQA ratios 1/4/8 plus a non-power-of-two one, head dims 64/128/80.
CONFIGS = [
    pytest.param(16, 4, 4, 64, torch.float32, id="bs16-mha-d64-fp32"),
    pytest.param(32, 8, 2, 128, torch.float32, id="bs32-gqa4-d128-fp32"),
    pytest.param(256, 8, 1, 64, torch.float32, id="bs256-gqa8-d64-fp32"),
    pytest.param(16, 16, 2, 128, torch.float16, id="bs16-gqa8-d128-fp16"),
    pytest.param(32, 8, 2, 64, torch.bfloat16, id="bs32-gqa4-d64-bf16"),
    pytest.param(256, 2, 2, 128, torch.float16, id="bs256-mha-d128-fp16"),
    pytest.param(24, 6, 2, 80, torch.float32, id="bs24-gqa3-d80-fp32"),
]

# A fresh prefill, a decode over a long context, a prefill continuing after a prefix-cache hit
# (context longer than the query), a chunk crossing several blocks, and a one-token prefix hit.
MIXED_SEQS = [(37, 37), (300, 1), (90, 20), (150, 70), (5, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), CONFIGS)
def test_mixed_batch_matches_dense_reference(
    device: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_batch(
        MIXED_SEQS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        num_pad_tokens=3,
        strided_q=True,
        seed=block_size + head_dim,
    )
    scale = head_dim**-0.5
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, num_splits=1)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert_close_to_reference(out, batch, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_writes_slots_and_skips_minus_one(device: str, block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 5, 2, 64, 40
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Rows taken from a fused projection output, so k and v are strided views.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep].cpu()
    expected_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep].cpu()

    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    assert not k.is_contiguous()
    tk.store_kvcache(k, v, k_dev, v_dev, slots.to(device))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim", "num_splits"),
    [(16, 8, 2, 128, 1), (32, 8, 1, 64, 4), (256, 4, 4, 64, 3)],
)
def test_decode_only_batch_with_and_without_split_kv(
    device: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int
) -> None:
    # Context lengths straddle block boundaries; one is shorter than a split's share of tiles,
    # so some of its segments are empty and must drop out of the merge.
    seqs = [(1, 1), (block_size + 1, 1), (257, 1), (64, 1)]
    batch = make_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
        seed=num_splits,
    )
    assert batch.meta.is_decode_only
    scale = head_dim**-0.5
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, num_splits=num_splits)
    assert_close_to_reference(out, batch, scale, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqs", [[(200, 120)], [(77, 77)], [(1, 1)]], ids=["prefix-hit", "fresh", "first-token"])
def test_single_sequence(device: str, seqs: list[tuple[int, int]]) -> None:
    batch = make_batch(
        seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert_close_to_reference(out, batch, 0.125, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_long_context_decode_with_automatic_splits(device: str) -> None:
    batch = make_batch(
        [(1500, 1), (700, 1)],
        num_heads=8,
        num_kv_heads=1,
        head_dim=128,
        block_size=32,
        dtype=torch.float16,
        device=device,
        seed=11,
    )
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 128**-0.5)
    assert_close_to_reference(out, batch, 128**-0.5, torch.float16)
    if device == "cuda":
        # Two sequences on one KV head leave an H100 nearly idle unless the KV range is split.
        cfg = tk._prepare(batch.q, batch.k_cache, batch.v_cache, batch.meta, None)[1]
        assert tk._auto_splits(batch.q, batch.meta, 2, cfg) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_on_mixed_batch_and_auto_choice(device: str) -> None:
    batch = make_batch(
        MIXED_SEQS[:3],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
        num_pad_tokens=2,
        seed=7,
    )
    scale = 0.125
    real = batch.num_real_tokens
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    for num_splits in (3, None):
        out = torch.full_like(batch.q, 7.0)
        result = tk.paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, out=out, num_splits=num_splits
        )
        assert result is out
        assert_close_to_reference(out, batch, scale, torch.float16)
        # Padding rows past query_start_loc[-1] are left as they were.
        assert bool((out[real:] == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "prefix_splits", "num_splits", "dtype"),
    [(16, 8, 2, 1, 1, torch.float32), (32, 8, 1, 2, 3, torch.float32), (16, 4, 4, 2, 1, torch.bfloat16)],
)
def test_cascade_shared_prefix_matches_dense_reference(
    device: str,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    prefix_splits: int,
    num_splits: int,
    dtype: torch.dtype,
) -> None:
    shared_blocks = 3
    prefix = shared_blocks * block_size
    # Decodes right after the prefix and deep into their own suffix, a prefill continuing right
    # at the prefix boundary, and a chunked prefill further on.
    seqs = [(prefix + 1, 1), (prefix + 70, 1), (prefix + 20, 20), (prefix + 60, 25), (prefix + 5, 1)]
    batch = make_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        device=device,
        num_pad_tokens=2,
        shared_prefix_blocks=shared_blocks,
        seed=prefix_splits + num_splits,
    )
    rows = batch.meta.block_tables.cpu().tolist()
    contexts = [seq_len - q_len for seq_len, q_len in seqs]
    assert tk.common_prefix_len(rows, contexts, block_size) == prefix
    scale = 0.125
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = torch.full_like(batch.q, 7.0)
    tk.cascade_paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.meta,
        scale,
        prefix,
        out=out,
        num_splits=num_splits,
        prefix_splits=prefix_splits,
    )
    assert_close_to_reference(out, batch, scale, dtype)
    assert bool((out[batch.num_real_tokens :] == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_rejects_prefix_not_in_whole_blocks(device: str) -> None:
    batch = make_batch(
        [(40, 1), (50, 20)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
        shared_prefix_blocks=1,
    )
    with pytest.raises(ValueError, match="multiple of block_size"):
        tk.cascade_paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 1.0, 24)


def test_common_prefix_len_stops_at_first_difference_and_shortest_context() -> None:
    tables = [[7, 3, 9, 4], [7, 3, 9, 5], [7, 3, 9, 4, 1]]
    assert tk.common_prefix_len(tables, [64, 64, 70], block_size=16) == 48
    # The shortest cached context (40 tokens) leaves only two whole blocks.
    assert tk.common_prefix_len(tables, [64, 40, 70], block_size=16) == 32
    assert tk.common_prefix_len([[7, 3], [8, 3]], [32, 32], block_size=16) == 0
    assert tk.common_prefix_len([[7, 3]], [32], block_size=16) == 0
    with pytest.raises(ValueError, match="context lengths"):
        tk.common_prefix_len(tables, [64], block_size=16)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_attn_states_recovers_full_softmax(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_heads, head_dim, num_keys = 5, 20, 64, 48
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(num_keys, num_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(num_keys, num_heads, head_dim, generator=gen, dtype=torch.float64)
    scores = torch.einsum("thd,khd->thk", q, k) * 0.1
    full = torch.einsum("thk,khd->thd", scores.softmax(-1), v)
    full_lse = scores.logsumexp(-1)
    # Three segments of keys plus an empty one (lse -inf, NaN output) in the middle.
    bounds = [(0, 10), (10, 10), (10, 31), (31, 48)]
    parts, lses = [], []
    for lo, hi in bounds:
        if lo == hi:
            parts.append(torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=torch.float64))
            lses.append(torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float64))
            continue
        s = scores[..., lo:hi]
        parts.append(torch.einsum("thk,khd->thd", s.softmax(-1), v[lo:hi]))
        lses.append(s.logsumexp(-1))
    stacked = torch.stack(parts).float().to(device)
    stacked_lse = torch.stack(lses).float().to(device)
    out_lse = torch.empty(num_tokens, num_heads, device=device)
    out = tk.merge_attn_states(stacked, stacked_lse, out_lse=out_lse)
    assert (out.cpu().double() - full).abs().max().item() < 1e-5
    assert (out_lse.cpu().double() - full_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_backend_stores_then_attends(device: str) -> None:
    batch = make_batch(
        [(33, 33), (70, 1), (60, 9)],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
        num_pad_tokens=1,
    )
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    out = backend.forward(batch.q, batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert_close_to_reference(out, batch, 0.125, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_inconsistent_shapes(device: str) -> None:
    batch = make_batch(
        [(20, 4)], num_heads=6, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        tk.paged_attention(batch.q[..., :32], batch.k_cache, batch.v_cache, batch.meta, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping[:1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("device_prefix", [48, 0], ids=["prefix-48", "prefix-0"])
def test_cascade_reads_prefix_len_from_device_tensor(device: str, device_prefix: int) -> None:
    # CUDA graphs replay cascade launches with the prefix length in device memory; 0 turns the
    # shared-prefix pass into a no-op and the suffix pass into plain paged attention.
    block_size, shared_blocks = 16, 3
    prefix = shared_blocks * block_size
    seqs = [(prefix + 1, 1), (prefix + 70, 1), (prefix + 9, 1), (prefix + 33, 1)]
    batch = make_batch(
        seqs,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
        shared_prefix_blocks=shared_blocks,
        seed=11,
    )
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    length = torch.tensor([device_prefix], dtype=torch.int32, device=device)
    out = tk.cascade_paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, length)
    assert_close_to_reference(out, batch, 0.125, torch.float32)
    with pytest.raises(ValueError, match="one int32 element"):
        tk.cascade_paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, length.long())


def test_common_prefix_len_matches_brute_force_on_random_tables() -> None:
    def brute(tables: list[list[int]], contexts: list[int], block_size: int) -> int:
        if len(tables) < 2:
            return 0
        n = 0
        while n < min(contexts) // block_size and all(row[n] == tables[0][n] for row in tables):
            n += 1
        return n * block_size

    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        num_rows = int(torch.randint(1, 6, (1,), generator=gen))
        shared = torch.randint(0, 50, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen).tolist()
        tables, contexts = [], []
        for _ in range(num_rows):
            # Rows copy the shared run, then diverge at a random point (possibly not at all).
            keep = int(torch.randint(0, len(shared) + 1, (1,), generator=gen))
            tail = torch.randint(0, 50, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).tolist()
            row = shared[:keep] + tail
            tables.append(row)
            contexts.append(int(torch.randint(0, len(row) * 4 + 1, (1,), generator=gen)))
        assert tk.common_prefix_len(tables, contexts, 4) == brute(tables, contexts, 4)


def release_behind_window(batch: Batch, window: int, block_size: int) -> int:
    """Do what the block manager does for an all-sliding model: every table entry wholly before the
    first query's window becomes -1 and its block is NaN-filled, so a kernel that reads one fails."""
    released = 0
    for i, (k, q_len) in enumerate(zip(batch.keys, batch.q_lens, strict=True)):
        first_needed = k.shape[0] - q_len - window + 1
        for b in range(max(first_needed, 0) // block_size):
            block = int(batch.meta.block_tables[i, b])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
            batch.meta.block_tables[i, b] = -1
            released += 1
    return released


# A fresh prompt longer than the window, decodes far past it and inside it, and prefill chunks
# after a prefix hit whose early blocks are released.
WINDOW_SEQS = [(70, 70), (300, 1), (20, 1), (150, 70), (97, 33)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("window", "block_size", "num_splits", "dtype"),
    [(48, 16, 1, torch.float32), (17, 16, 3, torch.float32), (100, 32, 1, torch.float16)],
)
def test_sliding_window_matches_dense_reference_with_released_blocks(
    device: str, window: int, block_size: int, num_splits: int, dtype: torch.dtype
) -> None:
    batch = make_batch(
        WINDOW_SEQS, num_heads=8, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype,
        device=device, seed=window,
    )  # fmt: skip
    assert release_behind_window(batch, window, block_size) > 0
    tk.store_kvcache(batch.k_new, batch.v_new, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, num_splits=num_splits, sliding_window=window
    )
    assert_close_to_reference(out, batch, 0.125, dtype, window)
    # The window is what the kernel honoured: full causal attention gives another answer.
    assert (dense_attention(batch, 0.125) - dense_attention(batch, 0.125, window)).abs().max() > 0.1


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="this process already runs the CPU checks itself")
def test_cpu_checks_in_fresh_interpreter_process(request: pytest.FixtureRequest) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", _FRESH_PROCESS_FLAG: "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=request.config.rootpath,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]
