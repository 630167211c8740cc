"""The LM head as int8 weights times int8 activations on the CPU (``lm_head_quantization="w8a8"``).

A decode step's LM head is the largest single weight it reads: SmolLM2-135M's 49152 x 576 is 57 MB in bfloat16,
nearly as much as the 30 layers' 4-bit projections together. Kept as int8 weights with bfloat16 activations
(``_weight_int8pack_mm``) it reads half the bytes but the kernel is compute-bound, and 4-bit groups lose too
much (top-1 agreement 0.82 against 0.965 on docs/quality.md's measure). Here both sides are int8 and the product
runs in fbgemm's integer GEMM (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``, VNNI where the CPU
has it), which is several times faster than either at one to sixteen rows (docs/benchmarks.md).

- Weights: symmetric int8 per output channel (absmax / 127), or a ``CpuInt8Linear``'s own codes and scales
  (a GGUF's Q8_0 embedding under ``quantization="gguf"``) taken as they are.
- Activations: each row divided by its own absolute maximum, then quantized with one fixed scale (1/127, zero
  point 128). The quantizer never sees the other rows, and the products accumulate in integers, so a row's
  logits are bit for bit the same whatever it is batched with (the deterministic mode keeps this head).

The kernel belongs to torch's quantized engine (fbgemm on x86). ``w8a8_problem`` says where it cannot run, and
the loader refuses the setting by name there.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from .cpu_linear import CpuInt4Linear, CpuInt8Linear

W8A8 = "w8a8"
LM_HEAD_QUANTIZATIONS: tuple[str, ...] = (W8A8,)
# The fixed activation quantizer: a row scaled into [-1, 1] maps onto codes 1..255 around 128.
_ACT_SCALE = 1.0 / 127.0
_ACT_ZERO = 128


def _op() -> torch._ops.OpOverloadPacket | None:
    quantized = getattr(torch.ops, "quantized", None)
    try:
        return getattr(quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)
    except (AttributeError, RuntimeError):
        return None


def _pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed form of int8 ``[N, K]`` codes with per-row float scales."""
    with warnings.catch_warnings():
        # torch marks quantized tensors as deprecated; they are still the only way into its packed int8 GEMM.
        warnings.simplefilter("ignore", UserWarning)
        zeros = torch.zeros(codes.shape[0], dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(codes.cpu(), scales.double().cpu(), zeros, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


@functools.cache
def w8a8_problem() -> str | None:
    """Why this torch / CPU cannot run the W8A8 LM head, or None when it can (one small product, checked)."""
    op = _op()
    if op is None:
        return f"torch {torch.__version__} has no quantized::linear_with_input_q_dq_qweight_dq_output_fp32"
    try:
        codes = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        out = op(torch.tensor([[1.0, 0.5]]), _ACT_SCALE, _ACT_ZERO, _pack(codes, torch.tensor([0.5, 0.25])))
    except RuntimeError as exc:  # no fbgemm / onednn kernel for this CPU's quantized engine
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch's quantized engine {torch.backends.quantized.engine!r} cannot run it: {first}"
    expected = torch.tensor([[0.0, 1.25]])  # (1 - 2 * 0.5) * 0.5, (3 + 4 * 0.5) * 0.25
    if not torch.allclose(out, expected, atol=0.02):
        return f"torch's quantized engine {torch.backends.quantized.engine!r} gave {out.tolist()}, not ~[[0, 1.25]]"
    return None


class CpuW8A8Linear(nn.Module):
    """``y = x @ W^T (+ b)``: int8 ``W`` per output channel, each row of ``x`` quantized to int8 by its own
    maximum, one integer GEMM; the output in ``x``'s dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        problem = w8a8_problem()
        if problem is not None:
            raise ValueError(f"lm_head_quantization='w8a8' cannot run: {problem}")
        if codes.dtype != torch.int8 or codes.dim() != 2 or tuple(scales.shape) != (codes.shape[0],):
            raise ValueError(f"W8A8 layer: int8 [N, K] codes and [N] scales, got {codes.dtype} "
                             f"{tuple(codes.shape)} and {tuple(scales.shape)}")  # fmt: skip
        self.out_features, self.in_features = codes.shape
        self.packed = _pack(codes.contiguous(), scales.float())
        # Held by fbgemm outside any tensor of the module: what weight accounting adds (quantization/memory.py).
        self.packed_bytes = codes.numel() + 4 * codes.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self._op = _op()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> CpuW8A8Linear:
        """Symmetric int8 per output channel from a float ``[N, K]`` weight. Unlike ``quantize_int8`` (whose kernel
        takes bfloat16 scales) the scales stay float32: fbgemm applies them in float32."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales, bias)

    @classmethod
    def from_module(cls, module: nn.Module) -> CpuW8A8Linear:
        """From the LM head as loaded: an ``nn.Linear``, a ``CpuInt8Linear`` (its codes kept) or a
        ``CpuInt4Linear`` (dequantized, then int8)."""
        if isinstance(module, CpuInt8Linear):
            bias = module.bias.data if module.bias is not None else None
            return cls(module.qweight, module.scales.float(), bias)
        if isinstance(module, CpuInt4Linear):
            bias = module.bias.data if module.bias is not None else None
            return cls.from_float(module.dequantized_weight(), bias)
        if isinstance(module, nn.Linear):
            return cls.from_float(module.weight.data, module.bias.data if module.bias is not None else None)
        raise ValueError(f"lm_head_quantization='w8a8' takes a linear LM head, not {type(module).__name__}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        peak = flat.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        out = self._op(flat / peak, _ACT_SCALE, _ACT_ZERO, self.packed) * peak
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize_lm_head(model: nn.Module, method: str) -> nn.Module:
    """Replace, in place, ``model.lm_head`` by its ``method`` form (``"w8a8"``). A tied embedding stays float:
    only the head's product changes."""
    if method != W8A8:
        raise ValueError(f"unknown lm_head_quantization {method!r}; use one of {LM_HEAD_QUANTIZATIONS} or None")
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(f"lm_head_quantization={method!r}: {type(model).__name__} has no lm_head")
    with torch.no_grad():
        model.lm_head = CpuW8A8Linear.from_module(head)
    return model
