"""The offload tiers of one engine, built once its KV cache exists and keyed by its configuration."""

from __future__ import annotations

from typing import Protocol

import torch

from .config import KVOffloadConfig
from .namespace import tier_namespace
from .offloader import KVOffloader


class _Config(Protocol):
    """What the tiers read of ``EngineConfig`` (typed here: importing it would close a circle through it)."""

    model: str
    quantization: str | None
    tensor_parallel_size: int
    block_size: int

    @property
    def offload_tiers(self) -> KVOffloadConfig | None: ...


class _Scales(Protocol):
    fixed: bool
    tensor: torch.Tensor


class _Runner(Protocol):
    """What the tiers read of the model runner: its cache and, for an FP8 cache, its scales."""

    kv_cache: torch.Tensor | None
    kv_scales: _Scales | None


def build_offloader(
    config: _Config, runner: _Runner, model_dtype: torch.dtype, record_events: bool
) -> KVOffloader | None:
    """The engine's offloader, or None without tiers. An FP8 cache's namespace includes its scales, known once
    they are fixed (after the cache's first step): until then nothing is written down or read back."""
    tiers, kv_cache = config.offload_tiers, runner.kv_cache
    if tiers is None or kv_cache is None:
        return None
    block_shape = tuple(kv_cache[:, :, 0].shape)

    def namespace() -> bytes | None:
        scales = runner.kv_scales
        if scales is not None and not scales.fixed:
            return None
        return tier_namespace(
            model=config.model,
            quantization=config.quantization,
            dtype=model_dtype,
            kv_cache_dtype=kv_cache.dtype,
            kv_scales=scales.tensor if scales is not None else None,
            tensor_parallel_size=config.tensor_parallel_size,
            block_size=config.block_size,
            block_shape=block_shape,
        )

    offloader = KVOffloader(tiers, kv_cache, namespace)
    offloader.record_events = record_events
    return offloader
