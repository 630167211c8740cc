"""The torch attention backend against a dense per-sequence reference: mixed decode and prefill
rows, cached context, fragmented and consecutive block tables, GQA, skipped slots, and a sliding window
whose released blocks (``-1`` in the table, NaN in the cache) are never read."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_workers.engine.attention import TorchAttentionBackend
from gpu_workers.engine.attention.metadata import AttentionMetadata
from gpu_workers.engine.attention.torch_backend import context_runs

BS = 4


def _reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """Dense causal attention of ``q`` (the last rows of a context) over ``keys``/``values``; with a
    window, position ``p`` sees keys ``p - window < k <= p`` only."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    q_pos = torch.arange(offset, offset + q.shape[0])[:, None]
    k_pos = torch.arange(keys.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


# (context length, new tokens) per sequence.
SHAPES = {
    # decode rows (attended as one batch), a fresh prefill, and chunks over cached context
    "mixed": [(9, 1), (13, 13), (1, 1), (20, 6), (7, 1), (16, 3)],
    # a pure decode step: every row in the one batched call
    "decode": [(9, 1), (5, 1), (12, 1), (3, 1), (10, 1)],
    # one long context among short ones: padding all to it costs more than the per-row loop
    "decode_uneven": [(40, 1), (2, 1), (3, 1), (1, 1)],
}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("shape_set", sorted(SHAPES))
def test_matches_dense_reference(
    num_heads: int, num_kv_heads: int, fragmented: bool, shape_set: str, window: int | None
) -> None:
    rng = random.Random(num_heads * 10 + fragmented)
    torch.manual_seed(0)
    head_dim, num_blocks, scale = 16, 64, 0.25
    shapes = SHAPES[shape_set]
    # Slots no sequence owns hold NaN, as free cache memory may: attention must never read them.
    k_cache = torch.full((num_blocks, BS, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = list(range(num_blocks))
    if fragmented:
        rng.shuffle(free)
    tables, dense_k, dense_v, slots, qs, ks, vs = [], [], [], [], [], [], []
    for ctx, new in shapes:
        blocks = [free.pop(0) for _ in range(-(-ctx // BS))]
        tables.append(blocks)
        kk = torch.randn(ctx, num_kv_heads, head_dim)
        vv = torch.randn(ctx, num_kv_heads, head_dim)
        dense_k.append(kk)
        dense_v.append(vv)
        cached = ctx - new
        for pos in range(cached):  # earlier steps already wrote these
            k_cache[blocks[pos // BS], pos % BS] = kk[pos]
            v_cache[blocks[pos // BS], pos % BS] = vv[pos]
        if window is not None:  # blocks behind the first query's window went back (NaN: never read)
            for b in range(max(cached - window + 1, 0) // BS):
                k_cache[blocks[b]] = v_cache[blocks[b]] = float("nan")
                blocks[b] = -1
        slots.extend(blocks[p // BS] * BS + p % BS for p in range(cached, ctx))
        qs.append(torch.randn(new, num_heads, head_dim))
        ks.append(kk[cached:])
        vs.append(vv[cached:])
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c for c, _ in shapes], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in shapes),
        max_seq_len=max(c for c, _ in shapes),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[c for c, _ in shapes],
    )
    backend = TorchAttentionBackend()
    q = torch.cat(qs)
    out = backend.forward(q, torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale, sliding_window=window)
    if window is None:  # the path under test was taken (a window evens the contexts out)
        assert (backend._group_states[0].plans[None].decode is None) == (shape_set == "decode_uneven")
    for i, (ctx, new) in enumerate(shapes):
        expected = _reference(qs[i], dense_k[i], dense_v[i], ctx - new, scale, window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, rtol=1e-5, atol=1e-5)
    # The new K/V landed in the cache at their slots.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], torch.cat(ks))


def test_negative_slots_are_not_stored() -> None:
    k_cache = torch.zeros(4, BS, 1, 8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 8)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, -1, 1]),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([1, 1, 2], dtype=torch.int32),
        block_tables=torch.zeros(3, 1, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=2,
        query_start_loc_cpu=[0, 1, 2, 3],
        seq_lens_cpu=[1, 1, 2],
    )
    TorchAttentionBackend().forward(torch.ones(3, 1, 8), k, k * 2, k_cache, v_cache, meta, 1.0)
    assert k_cache.view(-1, 1, 8)[:2].eq(1).all() and k_cache.view(-1, 1, 8)[2:].eq(0).all()


def test_context_runs_split_only_at_gaps() -> None:
    assert context_runs([5, 6, 7], 10, BS) == [(20, 30)]
    assert context_runs([5, 6, 9, 10, 2], 17, BS) == [(20, 28), (36, 44), (8, 9)]
    assert context_runs([3, 0, 0], 2, BS) == [(12, 14)]  # padding past the last block is ignored
    # From a position on (a sliding window): released entries before its block are not looked at.
    assert context_runs([-1, -1, 9, 10, 2], 17, BS, first_pos=9) == [(37, 44), (8, 9)]
