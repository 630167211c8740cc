"""Which engine features an architecture serves: a model class lists the ones it does not
(``unsupported_features``: feature name -> why), and ``check_features`` refuses an engine config that asks
for one of them, by name, before anything is loaded. Features not listed stack on every architecture."""

from __future__ import annotations

from collections.abc import Callable

from ..config import EngineConfig
from ..quantization.cpu_quant import CPU_QUANTIZATIONS
from .gguf_checkpoint import find_gguf

# How each feature shows in an engine config.
FEATURES: dict[str, Callable[[EngineConfig], bool]] = {
    "LoRA": lambda c: c.enable_lora,
    "tensor parallelism": lambda c: c.tensor_parallel_size > 1,
    "speculative decoding": lambda c: c.speculative_config is not None,
    "an FP8 KV cache": lambda c: c.kv_cache_dtype == "fp8",
    # A GGUF under a CPU method keeps the file's own blocks (``gguf_quantized.py``).
    "GGUF kept-quantized weights": lambda c: c.quantization in CPU_QUANTIZATIONS and find_gguf(c.model) is not None,
}


def check_features(model_cls: type, config: EngineConfig) -> None:
    """``ValueError`` naming the first feature ``config`` asks for that ``model_cls`` does not serve."""
    unsupported: dict[str, str] = getattr(model_cls, "unsupported_features", {})
    for feature, reason in unsupported.items():
        if feature not in FEATURES:
            raise RuntimeError(f"{model_cls.__name__} declares an unknown feature {feature!r}")
        if FEATURES[feature](config):
            raise ValueError(f"{feature} is not supported for {model_cls.__name__}: {reason}")
