"""Quantized weights for the engine: bitsandbytes LLM.int8() and NF4, FP8 (e4m3) W8A8 layers,
and INT4 AWQ / GPTQ checkpoints.

The engine loads a float model, calls ``check_quantization_supported`` early to fail fast, then
``quantize_model`` to swap its ``nn.Linear`` layers; ``weight_memory_bytes`` reports the result.
INT4 checkpoints come quantized: the loader builds ``Int4Linear`` layers (``int4_load.py``).
"""

from .bnb import BitsAndBytesUnavailableError
from .fp8 import Fp8Linear
from .int4_linear import Int4Linear
from .memory import weight_memory_bytes
from .quantize import (
    CHECKPOINT_QUANTIZATIONS,
    SUPPORTED_QUANTIZATIONS,
    QuantizationUnsupportedError,
    check_quantization_supported,
    quantize_model,
    skip_lm_head,
)

__all__ = [
    "CHECKPOINT_QUANTIZATIONS",
    "SUPPORTED_QUANTIZATIONS",
    "BitsAndBytesUnavailableError",
    "Fp8Linear",
    "Int4Linear",
    "QuantizationUnsupportedError",
    "check_quantization_supported",
    "quantize_model",
    "skip_lm_head",
    "weight_memory_bytes",
]
