"""Registry of supported architectures, keyed by the ``architectures`` entry of a HF config.json."""

from __future__ import annotations

from collections.abc import Iterable

from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def resolve_architecture(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """Pick the model class for a config's ``architectures`` list; a clear error if none is supported."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")


_FEATURE_NAMES = {"lora": "LoRA"}


def check_features(model_cls: type[LlamaForCausalLM], features: Iterable[str]) -> None:
    """Refuse, by name, the requested engine features the architecture declares it cannot run."""
    refused = [_FEATURE_NAMES.get(f, f.upper()) for f in sorted(set(features) & model_cls.unsupported_features)]
    if refused:
        verb = "is" if len(refused) == 1 else "are"
        raise ValueError(f"{' and '.join(refused)} {verb} not supported for {model_cls.__name__}")


__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "check_features",
    "resolve_architecture",
]
