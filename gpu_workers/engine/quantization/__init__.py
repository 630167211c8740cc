"""Quantized weights for the engine: bitsandbytes LLM.int8() and NF4, FP8 (e4m3) W8A8 layers,
INT4 AWQ / GPTQ checkpoints, and weights kept int8 / 4-bit on the CPU through torch's CPU kernels
(``cpu-int8``, ``cpu-int4``, ``gguf``: ``cpu_quant.py``).

The engine loads a float model, calls ``check_quantization_supported`` early to fail fast, then
``quantize_model`` to swap its ``nn.Linear`` layers; ``weight_memory_bytes`` reports the result.
INT4 checkpoints come quantized: the loader builds ``Int4Linear`` layers (``int4_load.py``).
"""

from .bnb import BitsAndBytesUnavailableError
from .cpu_linear import CpuInt4Linear, CpuInt8Linear
from .cpu_quant import CPU_QUANTIZATIONS
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
    "CPU_QUANTIZATIONS",
    "SUPPORTED_QUANTIZATIONS",
    "BitsAndBytesUnavailableError",
    "CpuInt4Linear",
    "CpuInt8Linear",
    "Fp8Linear",
    "Int4Linear",
    "QuantizationUnsupportedError",
    "check_quantization_supported",
    "quantize_model",
    "skip_lm_head",
    "weight_memory_bytes",
]
