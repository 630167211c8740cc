"""The CPU kept-quantized methods: which weights become ``CpuInt4Linear`` / ``CpuInt8Linear`` and from what.

- ``cpu-int8``: every projection int8 per output channel (``_weight_int8pack_mm``), quantized at load from a
  float checkpoint, or from a GGUF's tensors dequantized; the LM head stays float.
- ``cpu-int4``: every projection 4-bit in groups of 32 (``_weight_int4pack_mm_for_cpu``): a GGUF's Q4_0 /
  Q4_1 / Q4_K blocks taken as they are, anything else quantized min-max per group (Q4_1's scheme); an AWQ /
  GPTQ checkpoint's INT4 repacked as it is (no requantization). The LM head stays float.
- ``gguf``: a GGUF's own quantization kept: Q4_0 / Q4_1 / Q4_K tensors int4, Q8_0 int8 (requantized per
  output channel: the kernel has no per-block scales), the LM head too (the tied embedding's blocks when
  the file has no output tensor); every other type (F32, F16, BF16, Q5_K, Q6_K) stays float. The embedding
  lookup always stays float.

All of them run on the CPU only; the loader (``models/gguf_quantized.py`` for GGUF files, ``quantize_model``
for float checkpoints, ``repack_int4_layers`` for AWQ / GPTQ) builds the layers.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_linear import (
    DEFAULT_INT4_GROUP,
    INT4_GROUP_SIZES,
    CpuInt4Linear,
    CpuInt8Linear,
    int4_shape_problem,
    kernels_problem,
)
from .gguf_blocks import INT4_GGUF_TYPES
from .int4_formats import unpack_along_rows
from .int4_linear import Int4Linear

CPU_QUANTIZATIONS: tuple[str, ...] = ("cpu-int8", "cpu-int4", "gguf")
LayerKind = str  # "int4" or "int8"


def cpu_quantization_problem(method: str, device: torch.device | str) -> str | None:
    """Why ``method`` (one of ``CPU_QUANTIZATIONS``) cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cpu":
        return (
            f"quantization={method!r} keeps weights quantized for torch's CPU kernels and needs device='cpu', "
            f"not {str(device)!r} (on a GPU: an AWQ / GPTQ checkpoint, fp8, bnb-int8 or bnb-nf4)"
        )
    problem = kernels_problem()
    return None if problem is None else f"quantization={method!r} cannot run: {problem}"


def gguf_layer_kind(method: str, type_name: str, *, lm_head: bool) -> LayerKind | None:
    """The layer a GGUF projection of GGML type ``type_name`` becomes under ``method``; None: it stays float."""
    if method == "gguf":
        if type_name in INT4_GGUF_TYPES:
            return "int4"
        return "int8" if type_name == "Q8_0" else None
    if lm_head:
        return None
    return {"cpu-int4": "int4", "cpu-int8": "int8"}[method]


def cpu_layer_from_linear(method: str, linear: nn.Linear, name: str) -> nn.Module:
    """``quantize_model``'s conversion of one float ``nn.Linear`` for ``cpu-int8`` / ``cpu-int4``."""
    if method == "cpu-int8":
        return CpuInt8Linear.from_linear(linear)
    problem = int4_shape_problem(linear.out_features, linear.in_features, DEFAULT_INT4_GROUP)
    if problem is not None:
        raise ValueError(f"quantization='cpu-int4' cannot take {name}: {problem}")
    return CpuInt4Linear.from_linear(linear, DEFAULT_INT4_GROUP)


def _cpu_group(name: str, layer: Int4Linear) -> int:
    """The largest kernel group size that splits the checkpoint's groups (their scale and zero repeat)."""
    group = layer.group_size
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if group % size == 0:
            return size
    raise ValueError(
        f"quantization='cpu-int4' cannot take {name}: its checkpoint groups of {group} inputs split into none "
        f"of the CPU kernel's group sizes {INT4_GROUP_SIZES}"
    )


def int4_linear_to_cpu(layer: Int4Linear, name: str = "layer") -> CpuInt4Linear:
    """An AWQ / GPTQ ``Int4Linear`` as a ``CpuInt4Linear`` holding the same codes: ``(q - z) * s`` is scale
    ``s``, zero ``(8 - z) * s``. Act-order (``g_idx``) layers are refused: their groups are not contiguous."""
    if layer.g_idx is not None:
        raise ValueError(
            f"quantization='cpu-int4' cannot take {name}: act-order (desc_act) GPTQ groups are not contiguous "
            "inputs; leave quantization empty to run it through the dequantizing INT4 path"
        )
    group = _cpu_group(name, layer)
    problem = int4_shape_problem(layer.out_features, layer.in_features, group)
    if problem is not None:
        raise ValueError(f"quantization='cpu-int4' cannot take {name}: {problem}")
    repeat = layer.group_size // group
    codes = unpack_along_rows(layer.qweight).t()  # [N, K]
    scales = layer.scales.float()
    zeros = (8 - layer.zeros.float()) * scales
    out = CpuInt4Linear.from_codes(
        codes, scales.t().repeat_interleave(repeat, dim=1), zeros.t().repeat_interleave(repeat, dim=1), group
    )
    if layer.bias is not None:
        out.bias = nn.Parameter(layer.bias.data.clone(), requires_grad=False)
    return out


def repack_int4_layers(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``Int4Linear`` (an AWQ / GPTQ checkpoint, loaded) by its ``CpuInt4Linear``."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Int4Linear)]
    for name, layer in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, int4_linear_to_cpu(layer, name))
    return model
