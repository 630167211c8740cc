"""Attention one query token at a time over its own context in the cache: the deterministic mode's path.

The torch backend's usual paths make a token's attention depend on its company: decode rows share one call padded
to the longest context, and a prompt attends its fresh keys in one causal call whose reductions are not those of a
single query over the cache. Here every query token, in a prefill chunk or a decode step, makes the same call: its
query against the first ``position + 1`` cached keys and values of its own sequence. A prefill of N tokens then gives
bit for bit what N decode steps give, whatever the chunking, prefix-cache hits, preemption or other rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .kv_quant import fp8_codes_as

# Sequence i -> its cached (keys, values), each [seq_len, kv_heads, head_dim], this step's rows included.
ContextReader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def attend_per_token(
    q: torch.Tensor,
    context: ContextReader,
    query_start: list[int],
    seq_lens: list[int],
    scale: float,
    k_rows: torch.Tensor | None = None,
    v_rows: torch.Tensor | None = None,
    work: torch.dtype | None = None,
    starts: list[int] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``q`` ``[tokens, heads, d]`` -> the attention output of every token, each over its own cached context. An FP8
    cache passes its per-KV-head factors ``k_rows`` / ``v_rows`` (``[kv_heads, 1, 1]``) and the dtype to widen into
    (``work``); the scales join the query and the output, as on the backend's other paths. With a sliding
    ``window``, ``context(i)`` starts at position ``starts[i]`` and each token sees its last ``window`` positions."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    fp8 = k_rows is not None and v_rows is not None and work is not None
    out = torch.empty_like(q)
    for i, ctx_len in enumerate(seq_lens):
        start, end = query_start[i], query_start[i + 1]
        if start == end:
            continue
        keys, values = context(i)
        if fp8:
            keys, values = fp8_codes_as(keys, work), fp8_codes_as(values, work)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, ctx, d]
        num_kv_heads = keys.shape[0]
        first = ctx_len - (end - start)  # position of the chunk's first token
        offset = starts[i] if starts is not None else 0  # position of the context's first key
        for t in range(start, end):
            position = first + (t - start)
            lo = offset if window is None else max(offset, position - window + 1)
            query = q[t].view(num_kv_heads, num_heads // num_kv_heads, head_dim)
            if fp8:
                query = query.to(work) * k_rows
            seen = slice(lo - offset, position + 1 - offset)
            attn = F.scaled_dot_product_attention(query, keys[:, seen], values[:, seen], scale=scale)
            if fp8:
                attn = attn * v_rows
            out[t] = attn.reshape(num_heads, head_dim)
    return out
