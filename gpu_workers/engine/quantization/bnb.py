"""bitsandbytes conversions: turn a loaded float ``nn.Linear`` into an LLM.int8() ``Linear8bitLt``
or a 4-bit NF4 ``Linear4bit``, quantising on the layer's own device.

bitsandbytes is optional for the engine, so it is imported only when one of these methods is used.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

INSTALL_HINT = "pip install bitsandbytes  (version 0.50 or newer)"
# LLM.int8() outlier threshold: activation columns with any |value| above it run in 16-bit.
INT8_OUTLIER_THRESHOLD = 6.0
# NF4 absmax block size; 64 is the bitsandbytes / QLoRA default.
NF4_BLOCKSIZE = 64


class BitsAndBytesUnavailableError(RuntimeError):
    """bitsandbytes is needed for a ``bnb-*`` quantization method but cannot be imported."""


def import_bitsandbytes(method: str) -> ModuleType:
    """Import bitsandbytes or raise a clear error that says how to install it."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise BitsAndBytesUnavailableError(
            f"quantization={method!r} needs the bitsandbytes package, which is not importable ({exc}). "
            f"Install it with: {INSTALL_HINT}"
        ) from exc
    return bitsandbytes


def _copy_bias(src: nn.Linear, dst: nn.Linear) -> None:
    if src.bias is None:
        dst.bias = None
    else:
        dst.bias = nn.Parameter(src.bias.detach().clone(), requires_grad=False)


def to_int8(linear: nn.Linear) -> nn.Module:
    """LLM.int8(): int8 weights with one fp32 absmax scale per output row, outlier threshold 6.0."""
    bnb = import_bitsandbytes("bnb-int8")
    w = linear.weight.detach()
    layer = bnb.nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=INT8_OUTLIER_THRESHOLD,
        device="meta",  # the placeholder float weight is replaced below, so never allocate it
    )
    # Same math as Int8Params moving from CPU to a device, but done where the weight already lives,
    # so a model loaded straight onto the GPU is not round-tripped through host memory.
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16).contiguous())
    layer.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    _copy_bias(linear, layer)
    return layer


def to_nf4(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    """4-bit NormalFloat weights in blocks of 64 with fp32 absmax per block; matmuls in ``compute_dtype``.

    Double quantisation of the absmax values is off: it saves ~0.37 bit per weight but costs a
    second dequantisation on every matmul, and serving is bound by speed more than by that margin.
    """
    bnb = import_bitsandbytes("bnb-nf4")
    w = linear.weight.detach()
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=False,
        quant_type="nf4",
        quant_storage=torch.uint8,
        device="meta",
    )
    param = bnb.nn.Params4bit(
        w.contiguous(),
        requires_grad=False,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=False,
        quant_type="nf4",
        quant_storage=torch.uint8,
        module=layer,
    )
    # Params4bit quantises when first moved to a real device; moving to its own device does it in place.
    layer.weight = param.to(w.device)
    _copy_bias(linear, layer)
    return layer
