"""Attention backends over the paged KV cache and the rule that picks one for a device.

``auto`` prefers flash-attn on CUDA (when installed and the block size suits its paged kernel),
then the Triton kernel on CUDA, and the pure-torch reference everywhere else.
"""

from __future__ import annotations

import importlib.util

import torch

from .base import AttentionBackend
from .metadata import AttentionMetadata
from .torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")


def _flash_attn_problem(device: torch.device, block_size: int | None, dtype: torch.dtype | None) -> str | None:
    """Why flash-attn cannot serve this engine, or None when it can."""
    from .flash_attn_backend import FLASH_ATTN_BLOCK_MULTIPLE

    if device.type != "cuda":
        return "flash_attn needs a CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash_attn package is not installed"
    if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
        return (
            f"flash_attn's paged kernel needs block_size to be a multiple of {FLASH_ATTN_BLOCK_MULTIPLE} "
            f"(got {block_size}); use the triton backend for small blocks"
        )
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash_attn supports float16/bfloat16 only (got {dtype})"
    return None


def _make_triton() -> AttentionBackend:
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def get_attention_backend(
    name: str,
    device: torch.device | str,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Build the backend called ``name`` (or the best available one for ``"auto"``).

    Raises ``ValueError`` for an unknown name or a backend that cannot run here.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            if _flash_attn_problem(device, block_size, dtype) is None:
                from .flash_attn_backend import FlashAttnBackend

                return FlashAttnBackend()
            try:
                return _make_triton()
            except ImportError:
                pass
        return TorchAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention backend 'triton' needs a CUDA device")
        try:
            return _make_triton()
        except ImportError as exc:
            raise ValueError(f"attention backend 'triton' is unavailable: {exc}") from exc
    if name == "flash_attn":
        problem = _flash_attn_problem(device, block_size, dtype)
        if problem is not None:
            raise ValueError(f"attention backend 'flash_attn' is unavailable: {problem}")
        from .flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {', '.join(ATTENTION_BACKENDS)}")


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]
