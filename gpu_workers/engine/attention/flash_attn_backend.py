"""Attention through the ``flash_attn`` package (FlashAttention-2) reading the paged KV cache.

Steps with prefill rows use ``flash_attn_varlen_func`` with ``block_table``, so prefix-cache hits
and earlier chunks are read straight from the paged cache; pure decode steps use
``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens`` (one query per sequence,
no host sync, so it can be captured in a CUDA graph). Upstream flash-attn 2 accepts a paged cache
only when the block size is a multiple of 256 and the dtype is fp16/bf16; ``get_attention_backend``
checks both before picking this backend. Causal masking in flash-attn aligns the query block to
the end of the key range, which is exactly the "new tokens are the last q_len of the context"
layout of ``metadata.py``; a sliding-window layer passes ``window_size=(W - 1, 0)``, the same
``p - W < k <= p`` as the other backends. New K/V rows are written first with the Triton store kernel, which
skips slot -1 without a host sync (the torch fallback needs one). An FP8 KV cache is refused
(``FP8_KV_REFUSAL``): flash-attn 2 has no fp8 K/V input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata
from .torch_backend import write_kv

FLASH_ATTN_BLOCK_MULTIPLE = 256
# FlashAttention-2's kernels take fp16/bf16 K/V only. Dequantizing the whole cache each step would
# cost more memory traffic than the fp8 cache saves, so an FP8 cache is refused instead.
FP8_KV_REFUSAL = (
    "flash_attn (FlashAttention-2) cannot read an FP8 KV cache (its kernels take fp16/bf16 K/V only); "
    "use attention_backend='triton' (or 'auto', which picks it) with kv_cache_dtype='fp8', or kv_cache_dtype='auto'"
)

KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def flash_attn_block_size_problem(block_size: int) -> str | None:
    """Why ``block_size`` cannot back flash-attn's paged kernels, or None when it can."""
    if block_size > 0 and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0:
        return None
    return (
        f"flash_attn's paged KV kernels (FlashAttention-2) need block_size to be a multiple of "
        f"{FLASH_ATTN_BLOCK_MULTIPLE} (got {block_size}); pass block_size={FLASH_ATTN_BLOCK_MULTIPLE}, or use "
        "attention_backend='triton', which works with any block size"
    )


def _kv_writer() -> KVWriter:
    try:
        from .triton_kernels import store_kvcache
    except ImportError:  # pragma: no cover - torch ships triton wherever flash-attn builds
        return write_kv
    return store_kvcache


class FlashAttnBackend:
    name = "flash_attn"
    # Decode steps never sync with the host, so they can be captured in CUDA graphs.
    cuda_graph_safe = True

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._write_kv = _kv_writer()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if k_scale is not None or v_scale is not None or k_cache.dtype.itemsize == 1:
            # get_attention_backend refuses this pairing; a direct caller gets the same answer.
            raise ValueError(FP8_KV_REFUSAL)
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # flash-attn's window is (left, right) keys around the query, the query excluded from left.
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if meta.is_decode_only:
            # One query row per sequence: the decode kernel, with split-KV chosen by flash-attn.
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
                window_size=window,
            )
            return out.squeeze(1)
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, dim=0, dtype=torch.int32), (1, 0))
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=meta.block_tables,
        )
