"""The namespace a tier stores blocks under: a digest of everything that makes one engine's K/V differ from
another's for the same tokens. The chained block hash inside it names the tokens and the adapter; this names the
rest, so a tier never serves a block computed by another model, weights format, dtype, KV dtype or FP8 scales,
tensor-parallel layout or block size."""

from __future__ import annotations

import hashlib
import json

import torch


def tier_namespace(
    *,
    model: str,
    quantization: str | None,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    kv_scales: torch.Tensor | None,
    tensor_parallel_size: int,
    block_size: int,
    block_shape: tuple[int, ...],
) -> bytes:
    """16 bytes naming the configuration that computed a block. ``kv_scales`` are an FP8 cache's (fixed) scales:
    their exact values are part of the name, so blocks quantized with other scales are not found."""
    fields = {
        "model": model,
        "quantization": quantization or "",
        "dtype": str(dtype),
        "kv_cache_dtype": str(kv_cache_dtype),
        "tensor_parallel_size": tensor_parallel_size,
        "block_size": block_size,
        "block_shape": list(block_shape),
    }
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16)
    if kv_scales is not None:
        digest.update(kv_scales.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.digest()
