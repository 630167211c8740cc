"""FP8 (e4m3) W8A8 linear layers: weights quantised once per output channel, activations
quantised per token at every forward, product computed by ``torch._scaled_mm``.

Scheme (the "dynamic per-token / static per-channel" recipe vLLM also serves):
``y = (s_x * x_q) @ (s_w * w_q).T + b`` where ``x_q, w_q`` are float8_e4m3fn, ``s_x`` is one fp32
scale per token (row of ``x``) and ``s_w`` one fp32 scale per output channel (row of ``W``).
Each scale is ``amax / 448`` so the largest magnitude of a row maps onto e4m3's largest finite value.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Keeps all-zero rows (padding tokens, pruned channels) from dividing by zero; such rows quantise to 0.
MIN_SCALE = 1e-12
# cuBLASLt/CUTLASS FP8 GEMMs need the contraction dim and the output dim to be multiples of 16.
SCALED_MM_ALIGNMENT = 16
MIN_CUDA_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores

GemmMode = Literal["fused_bias", "separate_bias", "dequantized"]
_gemm_modes: dict[tuple[str, torch.dtype], GemmMode] = {}


def quantize_per_row(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D tensor to float8_e4m3fn with one fp32 scale per row.

    Returns ``(q, scale)`` with ``q`` contiguous ``[rows, cols]`` and ``scale`` ``[rows, 1]`` such
    that ``q.float() * scale`` approximates ``t``.
    """
    # Runs on the activations of every linear layer (128 times per decode step of an 8B Llama), so
    # it is kept to five small kernels instead of eight: the inf-norm does abs, fp32 cast and row
    # max in one reduction.
    amax = torch.linalg.vector_norm(t, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    # No clamp to +-448 before the cast: |t / scale| <= 448 up to one rounding step, and the e4m3fn
    # cast rounds every magnitude below 464 to at most 448 (only larger values would turn into NaN).
    q = torch.div(t, scale).to(FP8_DTYPE)
    return q, scale


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def cuda_capability_error(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on this CUDA device, or None when they can."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= MIN_CUDA_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
    need = ".".join(map(str, MIN_CUDA_CAPABILITY))
    return (
        f"quantization='fp8' needs a GPU with compute capability >= {need} (Ada or Hopper, e.g. L4, "
        f"L40S, H100); {name} ({device}) has compute capability {major}.{minor}. Use 'bnb-int8' or "
        f"'bnb-nf4' on this GPU instead."
    )


def _probe_scaled_mm(device: torch.device, out_dtype: torch.dtype, with_bias: bool) -> None:
    """Run one tiny row-wise scaled GEMM exactly as ``Fp8Linear`` does; raises if unsupported."""
    n = SCALED_MM_ALIGNMENT
    a, sa = quantize_per_row(torch.ones(n, n, device=device))
    b, sb = quantize_per_row(torch.ones(n, n, device=device))
    bias = torch.zeros(n, device=device, dtype=out_dtype) if with_bias else None
    torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), bias=bias, out_dtype=out_dtype)


def gemm_mode(device: torch.device, out_dtype: torch.dtype) -> GemmMode:
    """How ``Fp8Linear`` computes on ``device`` for activations of ``out_dtype`` (probed once, cached).

    ``fused_bias``: ``_scaled_mm`` with the bias in its epilogue. ``separate_bias``: ``_scaled_mm``
    then an add (cuBLASLt rejects a bias with fp32 output). ``dequantized``: no FP8 GEMM here at all.
    """
    key = (str(device), out_dtype)
    mode = _gemm_modes.get(key)
    if mode is not None:
        return mode
    if device.type == "cuda" and cuda_capability_error(device) is not None:
        mode = "dequantized"
    else:
        try:
            _probe_scaled_mm(device, out_dtype, with_bias=True)
            mode = "fused_bias"
        except (RuntimeError, NotImplementedError, TypeError):
            try:
                _probe_scaled_mm(device, out_dtype, with_bias=False)
                mode = "separate_bias"
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                logger.warning(
                    "torch._scaled_mm cannot run row-wise FP8 GEMMs on %s for %s output (%s); FP8 layers "
                    "there fall back to dequantising weights for each matmul (slower, weight-only FP8).",
                    device,
                    out_dtype,
                    exc,
                )
                mode = "dequantized"
    _gemm_modes[key] = mode
    return mode


def scaled_mm_error(device: torch.device) -> str | None:
    """Why row-wise FP8 ``_scaled_mm`` is unusable on ``device``, or None.

    CUDA devices are judged by compute capability first, then (when a GPU is really present) by a
    bf16 probe, which catches torch builds without row-wise FP8 kernels; other devices by an fp32 probe.
    """
    if device.type == "cuda":
        reason = cuda_capability_error(device)
        if reason is not None or not torch.cuda.is_available():
            return reason
    probe_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        _probe_scaled_mm(device, probe_dtype, with_bias=False)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return (
            f"quantization='fp8' needs torch._scaled_mm with float8_e4m3fn inputs and row-wise scales on "
            f"{device.type} (torch >= 2.13 provides it on CPU); torch {torch.__version__} says: {exc}"
        )
    return None


class Fp8Linear(nn.Module):
    """Drop-in replacement for ``nn.Linear`` holding float8_e4m3fn weights with per-channel scales.

    State: ``weight`` ``[N_pad, K_pad]`` float8_e4m3fn (row-major, so ``weight.t()`` is the
    column-major operand ``_scaled_mm`` wants), ``weight_scale`` ``[N_pad]`` fp32, optional ``bias``
    ``[N]`` in the activation dtype. ``N_pad``/``K_pad`` round ``out_features``/``in_features`` up to 16
    with zero rows/columns (a no-op for every Llama-family shape); inputs are zero-padded to
    ``K_pad`` and outputs cut back to ``N``.

    Forward: each token (row of the flattened input) is quantised with its own scale, then one
    ``torch._scaled_mm`` call multiplies, applies both scales and adds the bias. The only fallback
    is for devices where ``_scaled_mm`` has no row-wise FP8 kernel at all (CUDA GPUs below compute
    capability 8.9, or a backend whose probe fails, which is logged once): there the weight is
    dequantised and multiplied in the activation dtype. ``check_quantization_supported`` refuses
    such devices up front, so the fallback is only reached by moving a quantised model there later.

    ``.to(dtype)`` / ``.half()`` on a parent module move these tensors but keep their dtypes: a
    float8 weight or fp32 scale cast to bf16 would silently stop being FP8.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        n_pad = _round_up(out_features, SCALED_MM_ALIGNMENT)
        k_pad = _round_up(in_features, SCALED_MM_ALIGNMENT)
        self.weight = nn.Parameter(torch.zeros(n_pad, k_pad, device=device, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(n_pad, device=device, dtype=torch.float32), requires_grad=False)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantise an existing float ``nn.Linear`` on its own device."""
        w = linear.weight.detach()
        if w.dim() != 2 or not w.is_floating_point():
            raise ValueError(f"Fp8Linear.from_linear expects a 2-D floating weight, got {w.dtype} {tuple(w.shape)}")
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device=w.device, dtype=w.dtype
        )
        layer.load_float_weight(w)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @torch.no_grad()
    def load_float_weight(self, weight: torch.Tensor) -> None:
        """Quantise a float ``[out_features, in_features]`` weight into this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight shape {tuple(weight.shape)} does not match Fp8Linear ({self.out_features}, {self.in_features})"
            )
        q, scale = quantize_per_row(weight.to(self.weight.device))
        self.weight.data.zero_()
        self.weight.data[: self.out_features, : self.in_features] = q
        self.weight_scale.data.fill_(1.0)
        self.weight_scale.data[: self.out_features] = scale.squeeze(1)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight this layer represents, in ``dtype``."""
        w = self.weight[: self.out_features, : self.in_features].to(torch.float32)
        return (w * self.weight_scale[: self.out_features, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expected last dim {self.in_features}, got {tuple(x.shape)}")
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        mode = gemm_mode(x.device, x.dtype)
        if mode == "dequantized":
            return F.linear(x, self.dequantized_weight(x.dtype), bias)

        lead_shape = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        k_pad = self.weight.shape[1]
        if k_pad != self.in_features:
            x2d = F.pad(x2d, (0, k_pad - self.in_features))
        x_q, x_scale = quantize_per_row(x2d)
        n_pad = self.weight.shape[0]
        fuse_bias = mode == "fused_bias" and n_pad == self.out_features
        out = torch._scaled_mm(
            x_q,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale.view(1, n_pad),
            bias=bias if fuse_bias else None,
            out_dtype=x.dtype,
        )
        if n_pad != self.out_features:
            out = out[:, : self.out_features]
        if bias is not None and not fuse_bias:
            out = out + bias
        return out.reshape(*lead_shape, self.out_features)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        frozen = (self.weight, self.weight_scale)

        def move_keeping_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if any(t is f for f in frozen) and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out

        return super()._apply(move_keeping_dtype, recurse)

    def extra_repr(self) -> str:
        has_bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}, fp8_e4m3"
