"""Decode attention written in tensor operations alone, for a decode step that runs as one compiled graph.

The torch backend's eager decode path plans each step on the host (block tables as Python lists, runs of
consecutive slots, a padded gather worked out once per step). A compiled graph cannot call back into such
Python per layer without paying the call each time, so a compiled decode step (``execution/cpu_decode_compile.py``)
attends here instead: the step's block tables expand into every row's slots inside the graph, the rows' cached
contexts are gathered to ``[rows, kv_heads, blocks * block_size, head_dim]`` with the padding masked, the new token's
own key and value join as one more column, and the query heads sharing a KV head fold into the query-length axis
(no K/V copies for grouped-query attention), as the eager decode batch does. Arithmetic is float32 on the CPU,
like the eager path.

The graph never writes the cache: an in-place store into a view of the engine's one big cache tensor is
functionalized by the compiler into a copy of the whole cache per step (287 ms a step with a 1.8 GB cache). The
layers' new K/V are handed out instead (``meta.new_kv``, in layer order) and stored by the caller after the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def gathered_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caches as ``[slots, kv_heads, head_dim]`` views, and each row's context slots ``[rows, width *
    block_size]`` from its block table (padding blocks included: the caller masks them)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    offsets = torch.arange(block_size, device=k_cache.device, dtype=torch.int64)
    slots = (meta.block_tables.to(torch.int64).unsqueeze(-1) * block_size + offsets).flatten(1)
    return k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim), slots


def attend_decode_gathered(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``[rows, heads, head_dim]`` attention of one query row per sequence over its cached context and itself."""
    if meta.new_kv is None:
        raise RuntimeError("a compiled decode step needs meta.new_kv to hand its K/V out")
    meta.new_kv.append((k, v))
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    flat_k, flat_v, slots = gathered_slots(k_cache, v_cache, meta)
    cached = torch.arange(slots.shape[1], device=q.device).unsqueeze(0) < (meta.seq_lens.to(torch.int64) - 1)[:, None]
    mask = torch.cat([cached, cached.new_ones(rows, 1)], dim=1)[:, None, None, :]
    work = torch.float32 if q.device.type == "cpu" else q.dtype
    keys = torch.cat([flat_k[slots], k.unsqueeze(1)], dim=1).transpose(1, 2).to(work)  # [rows, kv_heads, ctx+1, d]
    values = torch.cat([flat_v[slots], v.unsqueeze(1)], dim=1).transpose(1, 2).to(work)
    query = q.reshape(rows, num_kv_heads, group, head_dim).to(work)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(rows, num_heads, head_dim).to(q.dtype)
