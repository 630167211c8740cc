"""Attention backends over the paged KV cache and the rule that picks one for a device.

``auto`` prefers flash-attn on CUDA (when installed and the block size suits its paged kernel),
then the Triton kernel on CUDA, and the pure-torch reference everywhere else. ``triton`` asked for
by name also runs on CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1`` set before
triton's first import), which is how the tests exercise it without a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

from .base import AttentionBackend
from .metadata import AttentionMetadata
from .torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")


def _flash_attn_problem(device: torch.device, block_size: int | None, dtype: torch.dtype | None) -> str | None:
    """Why flash-attn cannot serve this engine (every reason, joined), or None when it can."""
    from .flash_attn_backend import flash_attn_block_size_problem

    problems = []
    if device.type != "cuda":
        problems.append("flash_attn needs a CUDA device")
    if importlib.util.find_spec("flash_attn") is None:
        problems.append("the flash_attn package is not installed (pip install flash-attn)")
    if block_size is not None:
        problem = flash_attn_block_size_problem(block_size)
        if problem is not None:
            problems.append(problem)
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        problems.append(f"flash_attn supports float16/bfloat16 only (got {dtype})")
    return "; ".join(problems) or None


def _triton_interpreted() -> bool:
    from .triton_kernels import INTERPRETED

    return INTERPRETED


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
        try:
            backend = _make_triton()
        except ImportError as exc:
            raise ValueError(f"attention backend 'triton' is unavailable: {exc}") from exc
        if device.type != "cuda" and not _triton_interpreted():
            raise ValueError(
                "attention backend 'triton' needs a CUDA device (on CPU only under Triton's interpreter: "
                "TRITON_INTERPRET=1 set before triton is first imported)"
            )
        return backend
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
