"""Entry points the engine calls: validate a quantization method for a device, then swap every
``nn.Linear`` of a loaded float model for its quantised counterpart in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import bnb, fp8
from .cpu_experts import CpuQuantizedExperts, is_stacked_experts
from .cpu_linear import CpuInt4Linear, CpuInt8Linear
from .cpu_quant import CPU_QUANTIZATIONS, cpu_layer_from_linear, cpu_quantization_problem
from .int4_config import INT4_METHODS
from .int4_linear import Int4Linear

# Methods quantize_model runs on a float model ("cpu-int8" / "cpu-int4": the CPU kernels of cpu_quant.py).
SUPPORTED_QUANTIZATIONS: tuple[str, ...] = ("bnb-int8", "bnb-nf4", "fp8", "cpu-int8", "cpu-int4")
# Methods a checkpoint arrives quantized with (read by int4_load.py; "gguf": a GGUF file's own blocks, read by
# models/gguf_quantized.py); quantize_model never runs them.
CHECKPOINT_QUANTIZATIONS: tuple[str, ...] = (*INT4_METHODS, "gguf")


class QuantizationUnsupportedError(RuntimeError):
    """The method is known but this device (or this torch build) cannot run it."""


def check_quantization_supported(method: str, device: torch.device) -> None:
    """Raise a clear error unless ``method`` can run on ``device``.

    ValueError for an unknown method; ``BitsAndBytesUnavailableError`` (a RuntimeError naming the
    pip command) when bitsandbytes is missing; ``QuantizationUnsupportedError`` for FP8 on a CUDA GPU
    below compute capability 8.9 or a device whose torch has no row-wise FP8 ``_scaled_mm``, and for the CPU
    methods (``cpu-int8``, ``cpu-int4``, ``gguf``) anywhere but the CPU.
    """
    if method in CPU_QUANTIZATIONS:
        reason = cpu_quantization_problem(method, device)
        if reason is not None:
            raise QuantizationUnsupportedError(reason)
        return
    if method in CHECKPOINT_QUANTIZATIONS:
        return  # Int4Linear runs anywhere: the Triton kernel on CUDA, its torch fallback elsewhere
    if method not in SUPPORTED_QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization method {method!r}; supported: "
            f"{', '.join(SUPPORTED_QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS)} (or None for unquantised weights)"
        )
    device = torch.device(device)
    if method.startswith("bnb-"):
        bnb.import_bitsandbytes(method)
        return
    reason = fp8.scaled_mm_error(device)
    if reason is not None:
        raise QuantizationUnsupportedError(reason)


def skip_lm_head(name: str) -> bool:
    """Default skip rule: keep the output projection in full precision (it sets the logits directly)."""
    return name.rsplit(".", 1)[-1] == "lm_head"


def _is_quantized(module: nn.Module) -> bool:
    if isinstance(module, (fp8.Fp8Linear, Int4Linear, CpuInt4Linear, CpuInt8Linear, CpuQuantizedExperts)):
        return True
    return type(module).__module__.startswith("bitsandbytes")


def _model_dtype(linears: list[tuple[str, nn.Linear]]) -> torch.dtype:
    dtypes = {lin.weight.dtype for _, lin in linears}
    if len(dtypes) != 1:
        found = ", ".join(sorted(map(str, dtypes)))
        raise ValueError(f"quantize_model expects one float dtype across linear layers, found {found}")
    dtype = dtypes.pop()
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise ValueError(f"quantize_model expects float weights (fp32/fp16/bf16), found {dtype}")
    return dtype


def _quantize_experts(model: nn.Module, method: str, names: list[str]) -> None:
    """Replace each stacked experts module by its ``CpuQuantizedExperts``, one at a time (the float copy goes
    as soon as the quantized one exists)."""
    for name in names:
        module = model.get_submodule(name)
        check_quantization_supported(method, module.gate_up_proj.device)
        new = CpuQuantizedExperts.from_stacked(method, module.gate_up_proj.data, module.down_proj.data)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)


def quantize_model(
    model: nn.Module,
    method: str,
    *,
    skip: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` whose qualified name ``skip`` rejects with its quantised
    equivalent, converting the float weights it already holds on the device they are on.

    ``skip`` defaults to ``skip_lm_head``. Biases are kept. Methods: ``"bnb-int8"`` (bitsandbytes
    ``Linear8bitLt``), ``"bnb-nf4"`` (bitsandbytes ``Linear4bit``, NF4, compute dtype = model dtype),
    ``"fp8"`` (``Fp8Linear``), ``"cpu-int8"`` / ``"cpu-int4"`` (``CpuInt8Linear`` / ``CpuInt4Linear``, groups
    of 32; a mixture-of-experts layer's stacked experts too, one layer per expert: ``CpuQuantizedExperts``; the
    other methods have no expert kernel and refuse them; the router beside them stays float). Returns ``model``
    for chaining.
    """
    if method in CHECKPOINT_QUANTIZATIONS:
        raise ValueError(f"{method} weights come quantized in the checkpoint; quantize_model cannot produce them")
    skip = skip_lm_head if skip is None else skip
    experts = [name for name, module in model.named_modules() if is_stacked_experts(module)]
    if experts and method not in CPU_QUANTIZATIONS:
        raise ValueError(
            f"quantization={method!r} has no kernel for the stacked experts {experts[0]}; mixture-of-experts "
            "weights are kept quantized by 'cpu-int8' / 'cpu-int4' (on the CPU) only"
        )
    # A mixture-of-experts layer's router (its ``gate`` beside the experts) stays float: it only picks experts,
    # and its rounding would move tokens from one to another.
    routers = {f"{name.rpartition('.')[0]}.gate" for name in experts}
    targets: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if _is_quantized(module):
            raise ValueError(f"model is already quantized ({name or 'root'} is {type(module).__name__})")
        if isinstance(module, nn.Linear) and not skip(name) and name not in routers:
            if not name:
                raise ValueError("quantize_model needs a model holding linear layers, not a bare nn.Linear")
            targets.append((name, module))
    _quantize_experts(model, method, experts)
    if not targets:
        # Still validate, so a typo in `method` is never silently ignored.
        check_quantization_supported(method, torch.device("cpu"))
        return model

    dtype = _model_dtype(targets)
    devices = {lin.weight.device for _, lin in targets}
    for device in devices:
        check_quantization_supported(method, device)
        if method == "fp8":
            # Probe here, outside any CUDA-graph capture, so forward never has to.
            fp8.gemm_mode(device, dtype)

    # Each float layer is dropped as soon as its quantised copy exists, so the peak stays near the
    # float model's size (an 8B model: ~16 GB, not 16 GB float plus 8 GB FP8 held at once).
    targets.reverse()
    while targets:
        name, linear = targets.pop()
        if method in CPU_QUANTIZATIONS:
            new = cpu_layer_from_linear(method, linear, name)
        elif method == "bnb-int8":
            new = bnb.to_int8(linear)
        elif method == "bnb-nf4":
            new = bnb.to_nf4(linear, compute_dtype=dtype)
        else:
            new = fp8.Fp8Linear.from_linear(linear)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model
