"""Which engine features an architecture can run: each model class declares what it cannot
(``unsupported_features``: feature -> reason), and ``check_features`` refuses such a feature by name when an engine
asks for it, before anything is loaded or any tensor-parallel rank starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .llama import LlamaForCausalLM

# The features a model class may declare it cannot run.
FEATURES = ("lora", "tensor_parallel", "quantization")


def requested_features(config: EngineConfig) -> dict[str, str]:
    """The features ``config`` asks for, each with how an error should name it."""
    asked: dict[str, str] = {}
    if config.enable_lora:
        asked["lora"] = "LoRA"
    if config.tensor_parallel_size > 1:
        asked["tensor_parallel"] = f"tensor parallelism (tensor_parallel_size={config.tensor_parallel_size})"
    if config.quantization is not None:
        asked["quantization"] = f"quantization={config.quantization!r}"
    return asked


def check_features(model_cls: type[LlamaForCausalLM], config: EngineConfig) -> None:
    """``ValueError`` naming the feature and the architecture for the first asked feature it cannot run."""
    for feature, what in requested_features(config).items():
        reason = model_cls.unsupported_features.get(feature)
        if reason is not None:
            raise ValueError(f"{what} is not supported for {model_cls.__name__}: {reason}")
