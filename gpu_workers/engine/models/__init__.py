"""Registry of supported architectures, keyed by the ``architectures`` entry of a HF config.json."""

from __future__ import annotations

from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .moe_models import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_architecture(architectures: list[str] | None) -> type[LlamaForCausalLM]:
    """Pick the model class for a config's ``architectures`` list; a clear error if none is supported."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")


__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "resolve_architecture",
]
