"""``Int4Linear``: a projection whose weights stay 4-bit (AWQ / GPTQ checkpoints) in memory.

On CUDA the matmul runs the Triton dequant-GEMM (``int4_kernel.py``); elsewhere (CPU, or a build
without Triton) the torch fallback dequantizes the weight for the call and runs one ``matmul``:
memory stays 4-bit between calls, at the price of a transient float copy of one projection.
The packed layout is described in ``int4_formats.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from .int4_config import Int4Config
from .int4_formats import PACK, dequantize, num_groups


class Int4Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held as packed INT4 values, per-group zero points and scales.

    Tensors are buffers (not parameters): nothing here trains, and the loader fills them from the
    checkpoint. Only the bias is a parameter, so the float loader's bias slicing applies unchanged.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        cfg: Int4Config,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features % PACK:
            raise ValueError(f"INT4 layers need in_features divisible by {PACK}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = cfg.group_size or in_features
        groups = num_groups(cfg, in_features)
        factory = {"device": device}
        self.register_buffer("qweight", torch.empty((in_features // PACK, out_features), dtype=torch.int32, **factory))
        self.register_buffer("zeros", torch.empty((groups, out_features), dtype=torch.uint8, **factory))
        self.register_buffer("scales", torch.empty((groups, out_features), dtype=dtype, **factory))
        self.g_idx: torch.Tensor | None
        if cfg.desc_act:
            self.register_buffer("g_idx", torch.empty((in_features,), dtype=torch.int32, **factory))
        else:
            self.g_idx = None
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, **factory), requires_grad=False) if bias else None
        )

    def extra_repr(self) -> str:
        act_order = ", act_order" if self.g_idx is not None else ""
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}{act_order}"

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight ``[out, in]`` these INT4 values stand for (as ``nn.Linear.weight``)."""
        dtype = dtype or self.scales.dtype
        return dequantize(self.qweight, self.zeros, self.scales, self.g_idx, dtype).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.is_cuda:
            from .int4_kernel import int4_matmul

            out = int4_matmul(flat.contiguous(), self.qweight, self.scales, self.zeros, self.g_idx, self.group_size)
        else:
            weight = dequantize(self.qweight, self.zeros, self.scales, self.g_idx, flat.dtype)
            out = flat @ weight
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)
