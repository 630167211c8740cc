"""Attention backends over the paged KV cache and the rule that picks one for a device.

``auto`` prefers flash-attn on CUDA (when installed and the block size suits its paged kernel),
then the Triton kernel on CUDA, and the pure-torch reference everywhere else. ``triton`` asked for
by name also runs on CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1`` set before
triton's first import), which is how the tests exercise it without a GPU.

An FP8 KV cache (``kv_cache_dtype``, see ``kv_quant.py``) is read by the Triton and torch backends;
flash-attn 2 cannot read one, so ``auto`` then skips it and ``flash_attn`` by name is refused. On
CUDA the Triton kernels need float8e4nv, which Triton compiles for compute capability 8.9+ only.
"""

from __future__ import annotations

import importlib.util

import torch

from .base import AttentionBackend
from .metadata import AttentionMetadata
from .torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")
FP8_TRITON_MIN_CAPABILITY = (8, 9)


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


def _triton_fp8_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot use an FP8 KV cache on ``device``, or None when they can."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= FP8_TRITON_MIN_CAPABILITY:
        return None
    return (
        f"the Triton kernels' FP8 KV cache needs compute capability >= 8.9 (Ada, Hopper: Triton's float8e4nv); "
        f"{device} has {major}.{minor}. Use attention_backend='torch' or kv_cache_dtype='auto'"
    )


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
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Build the backend called ``name`` (or the best available one for ``"auto"``).

    ``kv_cache_dtype`` is the cache's dtype when it differs from ``dtype`` (float8_e4m3fn for an
    FP8 cache). Raises ``ValueError`` for an unknown name or a backend that cannot run here.
    """
    device = torch.device(device)
    fp8_kv = kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1
    if name == "auto":
        if device.type == "cuda":
            if not fp8_kv and _flash_attn_problem(device, block_size, dtype) is None:
                from .flash_attn_backend import FlashAttnBackend

                return FlashAttnBackend()
            if not (fp8_kv and _triton_fp8_problem(device)):
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
        problem = _triton_fp8_problem(device) if fp8_kv else None
        if problem is not None:
            raise ValueError(f"attention backend 'triton' is unavailable: {problem}")
        return backend
    if name == "flash_attn":
        if fp8_kv:
            from .flash_attn_backend import FP8_KV_REFUSAL

            raise ValueError(FP8_KV_REFUSAL)
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
