"""Attention through the ``flash_attn`` package's variable-length kernel reading the paged cache.

Upstream flash-attn 2 accepts a paged cache (``block_table``) only when the block size is a
multiple of 256 and the dtype is fp16/bf16; ``get_attention_backend`` checks both before picking
this backend. Causal masking in flash-attn aligns the query block to the end of the key range,
which is exactly the "new tokens are the last q_len of the context" layout of ``metadata.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata
from .torch_backend import write_kv

FLASH_ATTN_BLOCK_MULTIPLE = 256


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
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
            block_table=meta.block_tables,
        )
