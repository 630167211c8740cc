"""The interface every attention backend implements: write this step's K/V into the paged cache,
then attend each query token over its sequence's cached context."""

from __future__ import annotations

from typing import Protocol

import torch

from .metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """One instance per engine; called once per layer per step.

    Shapes: ``q`` is ``[num_tokens, num_heads, head_dim]``; ``k`` and ``v`` are
    ``[num_tokens, num_kv_heads, head_dim]``; caches follow ``metadata.py``. A slot of ``-1`` in
    ``meta.slot_mapping`` means "do not store" (padding rows of a CUDA-graph batch). Returns a
    ``[num_tokens, num_heads, head_dim]`` tensor in ``q``'s dtype. An FP8 (float8_e4m3fn) cache
    comes with the layer's ``k_scale``/``v_scale`` (fp32 ``[num_kv_heads]``, see ``kv_quant.py``):
    rows are stored as ``x / scale`` and read back times the scale; with
    ``meta.calibrate_kv_scales`` the backend first sets the scales from this step's K/V.
    ``sliding_window=W`` (a sliding layer) limits query position ``p`` to keys ``p - W < k <= p``;
    block-table entries wholly before the first query's window may be released (``-1``) and are
    never read.

    Optional class attributes the model runner reads (absent means False): ``supports_cascade``,
    the backend honours ``meta.common_prefix_len`` (shared-prefix attention); ``cuda_graph_safe``,
    its decode path never syncs with the host, so decode steps may be captured in CUDA graphs.
    """

    name: str

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
    ) -> torch.Tensor: ...
