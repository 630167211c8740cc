"""A mixture-of-experts layer's stacked experts kept quantized on the CPU: one ``CpuInt4Linear`` /
``CpuInt8Linear`` per expert and projection (``gate_up`` ``[2I, H]``, gate rows then up rows, and ``down``
``[H, I]``), so each routed expert's GEMM runs through the same kernels as a dense kept-quantized projection.

It stands in for ``models/moe.py``'s ``MoEExperts`` (whose stacked float parameters it replaces): the block groups
the routed tokens by expert as its torch path does and calls ``gate_up(expert, rows)`` / ``down(expert, rows)``
per group. Built empty and filled from a GGUF's blocks (``models/gguf_quantized.py``), or quantized from the
float stacked weights by ``quantize_model`` (``cpu-int8`` / ``cpu-int4``).
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_linear import DEFAULT_INT4_GROUP, CpuInt4Linear, CpuInt8Linear, int4_shape_problem, quantize_int4

KINDS = ("int4", "int8")


def _empty(
    kind: str, in_features: int, out_features: int, dtype: torch.dtype | None, device: torch.device | str | None
) -> nn.Module:
    if kind == "int4":
        return CpuInt4Linear(in_features, out_features, False, DEFAULT_INT4_GROUP, dtype=dtype, device=device)
    return CpuInt8Linear(in_features, out_features, bias=False, dtype=dtype, device=device)


class CpuQuantizedExperts(nn.Module):
    """``num_experts`` experts of hidden size ``hidden_size`` and intermediate size ``intermediate_size``, their
    ``gate_up`` projections of kind ``gate_up_kind`` and ``down`` of ``down_kind`` (``int4`` or ``int8``; a GGUF
    may hold them in different types)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        gate_up_kind: str,
        down_kind: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for kind, out_features, in_features in (
            (gate_up_kind, 2 * intermediate_size, hidden_size),
            (down_kind, hidden_size, intermediate_size),
        ):
            if kind not in KINDS:
                raise ValueError(f"kept-quantized experts: kind {kind!r} is not one of {KINDS}")
            problem = int4_shape_problem(out_features, in_features, DEFAULT_INT4_GROUP) if kind == "int4" else None
            if problem is not None:
                raise ValueError(f"int4 experts [{out_features}, {in_features}]: {problem}")
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.ModuleList(
            _empty(gate_up_kind, hidden_size, 2 * intermediate_size, dtype, device) for _ in range(num_experts)
        )
        self.down_proj = nn.ModuleList(
            _empty(down_kind, intermediate_size, hidden_size, dtype, device) for _ in range(num_experts)
        )

    @classmethod
    def from_stacked(cls, method: str, gate_up: torch.Tensor, down: torch.Tensor) -> CpuQuantizedExperts:
        """Quantize float stacked weights ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` for ``cpu-int4`` (groups of
        32, min-max: ``CpuInt4Linear.from_float``) or ``cpu-int8`` (per output channel)."""
        kind = {"cpu-int4": "int4", "cpu-int8": "int8"}.get(method)
        if kind is None:
            raise ValueError(f"experts are quantized at load by 'cpu-int4' or 'cpu-int8', not {method!r}")
        num_experts, two_inter, hidden = gate_up.shape
        experts = cls(num_experts, hidden, two_inter // 2, kind, kind, gate_up.dtype, gate_up.device)
        with torch.no_grad():
            for expert in range(num_experts):
                experts.fill(expert, "gate_up", gate_up[expert])
                experts.fill(expert, "down", down[expert])
        return experts

    def fill(
        self, expert: int, proj: str, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> None:
        """Fill expert ``expert``'s ``proj`` (``gate_up`` or ``down``): an int4 layer from a float weight or from
        (codes, scale, zero) as ``CpuInt4Linear.set_codes`` takes them, an int8 layer from a float weight."""
        layer = (self.gate_up_proj if proj == "gate_up" else self.down_proj)[expert]
        if isinstance(layer, CpuInt4Linear):
            layer.set_codes(*(weight if isinstance(weight, tuple) else quantize_int4(weight, DEFAULT_INT4_GROUP)))
        elif isinstance(weight, tuple):
            raise ValueError(f"expert {expert} {proj} is int8: it takes a float weight, not 4-bit codes")
        else:
            assert isinstance(layer, CpuInt8Linear)
            layer.set_float(weight)

    def gate_up(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return self.gate_up_proj[expert](rows)

    def down(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return self.down_proj[expert](rows)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 stacked weights the kernels multiply by (slow, for checks)."""
        gate_up = torch.stack([layer.dequantized_weight() for layer in self.gate_up_proj])
        return gate_up, torch.stack([layer.dequantized_weight() for layer in self.down_proj])


def is_stacked_experts(module: nn.Module) -> bool:
    """A float experts module as transformers and ``models/moe.py`` stack them: ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]`` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
