"""Quantized weights for the engine: bitsandbytes LLM.int8() and NF4, and FP8 (e4m3) W8A8 layers.

The engine loads a float model, calls ``check_quantization_supported`` early to fail fast, then
``quantize_model`` to swap its ``nn.Linear`` layers; ``weight_memory_bytes`` reports the result.
"""

from .bnb import BitsAndBytesUnavailableError
from .fp8 import Fp8Linear
from .memory import weight_memory_bytes
from .quantize import (
    SUPPORTED_QUANTIZATIONS,
    QuantizationUnsupportedError,
    check_quantization_supported,
    quantize_model,
    skip_lm_head,
)

__all__ = [
    "SUPPORTED_QUANTIZATIONS",
    "BitsAndBytesUnavailableError",
    "Fp8Linear",
    "QuantizationUnsupportedError",
    "check_quantization_supported",
    "quantize_model",
    "skip_lm_head",
    "weight_memory_bytes",
]
