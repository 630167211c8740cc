"""Attention for the deterministic mode's compiled CPU steps: every query token alone over its own context, in tensor
operations a compiled graph can hold, with each token's numbers independent of the other rows and of their lengths.

Under the deterministic mode a compiled step (``execution/cpu_decode_compile.py``) takes every token as a row of its
own, prompt tokens included (``execution/invariant_rows.py``): a row's context is its sequence's first ``position +
1`` keys, read from the cache where an earlier step stored them and from this step's fresh K/V where this step
computes them (the graph never writes the cache; ``meta.fresh_from`` is the position of the first key the step
computes for the row's sequence). So a prompt token gets exactly the arithmetic of a decode step at its position.

The contexts are gathered padded to the step's widest block table, so no reduction may see the padding:

- scores are products over ``head_dim`` alone (their reduction length fixed);
- the softmax's maximum is exact whatever the order, and masked keys give exactly zero weight;
- the denominator is not a separate sum (a vectorized reduction over the context would split it into lanes by
  its padded length): a column of ones rides with the values, so ``P @ [V | 1]`` computes numerator and denominator
  in the same ordered pass, to which the trailing zero weights add exactly nothing.

The promise is the compiled graph's, whose one loop nest serves every row count: run eagerly, torch's own reductions
choose their strategy by shape. ``tests/unit/engine/test_gathered_invariant.py`` checks a row's compiled output alone
and beside rows of other lengths, and as a prompt token against the same token decoded.
"""

from __future__ import annotations

import torch

from .gathered_decode import gathered_slots
from .metadata import AttentionMetadata


def attend_rows_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``[rows, heads, head_dim]``: each row's query over its sequence's keys ``0 .. seq_len - 1``."""
    if meta.new_kv is None or meta.fresh_from is None:
        raise RuntimeError("an invariant compiled step needs meta.new_kv and meta.fresh_from")
    meta.new_kv.append((k, v))
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    flat_k, flat_v, slots = gathered_slots(k_cache, v_cache, meta)  # slots: [rows, ctx]
    key_pos = torch.arange(slots.shape[1], device=q.device).unsqueeze(0)
    position = (meta.seq_lens.to(torch.int64) - 1).unsqueeze(1)
    visible = key_pos <= position
    fresh = (key_pos >= meta.fresh_from.to(torch.int64).unsqueeze(1)) & visible
    # The row of this step that computed key ``j`` of row ``r``'s sequence: a sequence's rows are consecutive.
    source = (torch.arange(rows, device=q.device).unsqueeze(1) - position + key_pos).clamp(0, rows - 1)
    fresh4, visible4 = fresh[..., None, None], visible[..., None, None]
    keys = torch.where(fresh4, k[source], flat_k[slots])
    # Hidden values are zeroed, not only weighted zero: a stale slot could hold anything, and 0 * inf is NaN.
    values = torch.where(visible4, torch.where(fresh4, v[source], flat_v[slots]), 0)
    work = torch.float32 if q.device.type == "cpu" else q.dtype
    keys = keys.transpose(1, 2).to(work)  # [rows, kv_heads, ctx, d]
    ones = visible[:, None, :, None].expand(rows, num_kv_heads, slots.shape[1], 1).to(work)
    values = torch.cat([values.transpose(1, 2).to(work), ones], dim=-1)  # [rows, kv_heads, ctx, d + 1]
    query = q.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim).to(work)
    # Products and sums written out rather than batched matmuls: a BLAS picks its kernel by the batch's size (a
    # row's P @ V came out differently beside 2 to 6 other rows than alone or beside 8), while the compiled graph
    # runs one loop nest for every row count.
    scores = (query.unsqueeze(-2) * keys.unsqueeze(2)).sum(dim=-1) * scale  # [rows, kv_heads, group, ctx]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    # [rows, kv_heads, group, d + 1]: numerator and denominator in one pass over the context, in key order, a block
    # at a time: the compiler sums a float reduction longer than 4096 in chunks of its own, so one sum over the
    # whole context would change arithmetic with the step's widest table; these two never pass that length
    # (``cpu_decode_compile.MAX_INVARIANT_BLOCKS``).
    blocks = slots.shape[1] // block_size
    products = (
        weights.unflatten(-1, (blocks, block_size)).unsqueeze(-1)
        * values.unflatten(2, (blocks, block_size))[:, :, None]
    )
    summed = products.sum(dim=-2).sum(dim=-2)
    out = summed[..., :head_dim] / summed[..., head_dim:]
    return out.reshape(rows, num_heads, head_dim).to(q.dtype)
