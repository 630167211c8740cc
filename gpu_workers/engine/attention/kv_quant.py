"""The FP8 (e4m3) KV cache: its dtype names, its per-layer/per-KV-head scales, and the torch-side
quantize step (the torch backend's write; the Triton store kernel does the same in-kernel).

Scheme (vLLM's ``kv_cache_dtype="fp8"``): every layer has one fp32 scale per KV head for K and one for
V, a stored element is ``q = e4m3(x / scale)`` and reads as ``q * scale``. Scales are fixed for the
cache's life because a block written under one scale cannot be read under another (prefix-cache hits
and preempted sequences reread old blocks): they come from the checkpoint (``self_attn.k_scale`` /
``v_scale``, or the older shared ``kv_scale``) or are computed from the first forward step's new K/V
(the first prompts) with ``CALIBRATION_HEADROOM`` of room above the largest magnitude seen, so later
prompts with somewhat larger keys or values still fit before saturating at +-448.

Only importable things from torch live here, so the torch backend and the model runner can use it
on machines without triton.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448.0
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# The first prompts' largest |K| (|V|) per head maps onto 448 / headroom: room for 2x larger values
# later. e4m3's relative precision is the same over its normal range, so the headroom costs only
# subnormals below amax / (224 * 64), which attention cannot tell from zero.
CALIBRATION_HEADROOM = 2.0
# An all-zero head (a pruned head, a zero prompt) would give scale 0 and a division by zero.
MIN_KV_SCALE = 1e-8


def parse_kv_cache_dtype(value: str) -> torch.dtype | None:
    """``"auto"`` -> None (the cache takes the model's dtype); ``"fp8"``/``"fp8_e4m3"`` -> float8_e4m3fn."""
    name = str(value).lower() if isinstance(value, str) else value
    if name == "auto":
        return None
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    hint = " (fp8_e5m2 is not supported: e4m3 keeps one more mantissa bit)" if name == "fp8_e5m2" else ""
    raise ValueError(f"unknown kv_cache_dtype {value!r}; choose one of {', '.join(KV_CACHE_DTYPES)}{hint}")


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


class KVScales:
    """The ``[2, num_layers, num_kv_heads]`` fp32 scales of an FP8 cache (K at 0, V at 1) on the
    cache's device, and whether they are fixed yet. Per-layer rows are views, so kernels and CUDA
    graphs read fixed addresses while calibration fills them in place."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device, given: torch.Tensor | None) -> None:
        shape = (2, num_layers, num_kv_heads)
        self.tensor = torch.ones(shape, dtype=torch.float32, device=device)
        # Host flag: True once the scales may no longer change (given, or computed on the first step).
        self.fixed = given is not None
        if given is not None:
            if tuple(given.shape) != shape:
                raise ValueError(f"KV cache scales must be {shape}; got {tuple(given.shape)}")
            if not bool(torch.isfinite(given).all()) or bool((given <= 0).any()):
                raise ValueError("KV cache scales must be positive and finite")
            self.tensor.copy_(given)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` of one layer, each ``[num_kv_heads]``."""
        return self.tensor[0, index], self.tensor[1, index]


def calibrate_scales(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Set one layer's scales in place from this step's new ``[tokens, kv_heads, head_dim]`` K/V."""
    for rows, scale in ((k, k_scale), (v, v_scale)):
        amax = rows.detach().abs().amax(dim=(0, 2)).float()
        scale.copy_((amax * (CALIBRATION_HEADROOM / FP8_KV_MAX)).clamp_(min=MIN_KV_SCALE))


def quantize_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[tokens, kv_heads, head_dim]`` rows -> float8_e4m3fn with one scale per KV head (round to
    nearest even, saturating at +-448: the e4m3fn cast itself would turn larger values into NaN)."""
    scaled = x.float() / scale[:, None]
    return scaled.clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


# float8_e4m3fn codes widened into float16 bits (see ``fp8_codes_as``) read as the e4m3 value / 256.
FP8_AS_FP16_FACTOR = 256.0


def fp8_codes_as(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn rows -> ``dtype`` holding exactly each value / ``FP8_AS_FP16_FACTOR``.

    torch's own float8 cast runs element by element on a CPU (about 5x slower than the integer ops
    here, which vectorize): the sign bit moves to fp16's, and exponent + mantissa (7 bits) shift up
    by 7, which is the same number in fp16 scaled by 2^(7 - 15) for normals and subnormals alike.
    Callers fold the factor into their scales. (The e4m3 NaN code would read as 480 / 256; the
    quantizers saturate, so the cache never holds it.)"""
    codes = cache_rows.view(torch.uint8).to(torch.int16)
    bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
    return bits.view(torch.float16).to(dtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize_rows` up to rounding, in ``dtype``."""
    return q.to(dtype) * scale[:, None].to(dtype)
