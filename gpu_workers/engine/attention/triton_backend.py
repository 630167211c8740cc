"""The "triton" attention backend: FlashAttention-style Triton kernels over the paged KV cache, for
any block size, mixed prefill/decode batches in one launch, GQA, and an FP8 (e4m3) KV cache.

Importing this module raises ImportError when the ``triton`` package is not installed, so the
backend selector can fall back to another backend.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401  (imported first to turn a missing package into one clear error)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the 'triton' attention backend needs the triton package (pip install triton)") from exc

import torch

from .kv_quant import calibrate_scales
from .metadata import AttentionMetadata
from .triton_kernels import cascade_paged_attention, paged_attention, store_kvcache


class TritonAttentionBackend:
    """Writes this step's K/V into the paged cache, then runs the unified paged-attention kernel,
    or, when the metadata carries a shared prefix (``common_prefix_len > 0``), cascade attention:
    the prefix once for the whole batch, each sequence's own suffix, and a merge."""

    name = "triton"
    # Reads common_prefix_len; never syncs with the host (decode steps can be CUDA graphs).
    supports_cascade = True
    cuda_graph_safe = True

    def __init__(self) -> None:
        # The deterministic mode (execution/batch_invariant_triton.py) swaps in its fixed-split attention, which
        # covers the whole context itself: no cascade, whose prefix pass would make a row depend on the batch.
        self.batch_invariant = False
        self.attention = paged_attention

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
        # An FP8 cache: the kernels quantize on store and dequantize on read with these scales.
        if meta.calibrate_kv_scales and k_scale is not None and v_scale is not None:
            calibrate_scales(k, v, k_scale, v_scale)
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        # The cascade's shared-prefix pass has no window; a sliding layer attends the plain way (the model
        # runner turns cascade off for models with sliding layers, so this is only a guard).
        if meta.common_prefix_len > 0 and sliding_window is None and not self.batch_invariant:
            device_len = meta.common_prefix_len_device
            shared = device_len if device_len is not None else meta.common_prefix_len
            return cascade_paged_attention(
                q, k_cache, v_cache, meta, scale, shared, num_splits=None, prefix_splits=None,
                k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return self.attention(
            q, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window
        )
