"""Registry of supported architectures, keyed by the ``architectures`` entry of a HF config.json: the model class
of each (``MODEL_REGISTRY``) and what is known of it (``ARCHITECTURE_INFO``, in ``architectures.py``)."""

from __future__ import annotations

from .architectures import ARCHITECTURE_INFO, FEATURES, ArchitectureInfo, check_features
from .gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .moe_models import MixtralForCausalLM, Qwen3MoeForCausalLM
from .phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}


def resolve_architecture_name(architectures: list[str] | None) -> str:
    """The first name of a config's ``architectures`` list the engine supports; a clear error if none is."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return name
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")


def resolve_architecture(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """Pick the model class for a config's ``architectures`` list; a clear error if none is supported."""
    return MODEL_REGISTRY[resolve_architecture_name(architectures)]


__all__ = [
    "ARCHITECTURE_INFO",
    "FEATURES",
    "MODEL_REGISTRY",
    "ArchitectureInfo",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "check_features",
    "resolve_architecture",
    "resolve_architecture_name",
]
