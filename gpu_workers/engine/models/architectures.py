"""What the engine knows of each architecture it loads: its Hugging Face name, the GGUF ``general.architecture``
names it converts from, its family, and the engine features it cannot run with, each with the reason.

``check_features`` is the one place a feature the architecture cannot run with is refused, by name, when the model
loads (``"LoRA is not supported for Gemma3ForCausalLM: ..."``); docs/models.md's table of architectures and
features is checked against :data:`ARCHITECTURE_INFO` by a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig

#: Engine features an architecture may refuse: name -> how error messages and docs/models.md call it.
FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "prefix_caching": "Prefix caching",
        "cuda_graphs": "CUDA graphs",
        "fp8_kv_cache": "FP8 KV cache",
        "speculative_decoding": "Speculative decoding",
        "lora": "LoRA",
        "fp8_weights": "FP8 weight quantization",
        "bnb_quantization": "bitsandbytes quantization",
        "cpu_quantization": "CPU int8 / int4 weight quantization",
        "int4_checkpoints": "AWQ / GPTQ quantization",
        "tensor_parallel": "Tensor parallelism",
        "gguf_quantized": "GGUF kept-quantized weights",
    }
)


@dataclass(frozen=True)
class ArchitectureInfo:
    """One architecture: ``unsupported`` maps each feature of :data:`FEATURES` it cannot run with to the reason."""

    hf_name: str
    family: str
    gguf_names: tuple[str, ...] = ()
    unsupported: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.unsupported) - set(FEATURES))
        if unknown:
            raise ValueError(f"{self.hf_name}: unknown features {unknown}; known: {', '.join(FEATURES)}")

    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise KeyError(f"unknown feature {feature!r}; known: {', '.join(FEATURES)}")
        return feature not in self.unsupported

    def refuse(self, feature: str) -> None:
        """``ValueError`` naming the feature and the architecture when it cannot run with it."""
        if not self.supports(feature):
            raise ValueError(f"{FEATURES[feature]} is not supported for {self.hf_name}: {self.unsupported[feature]}")


# Why the features a mixture-of-experts model cannot run are refused.
_MOE_UNSUPPORTED: Mapping[str, str] = MappingProxyType(
    {
        "lora": "its expert MLPs have no LoRA layers",
        "fp8_weights": "its stacked experts have no FP8 kernel (they would stay float); on the CPU use cpu-int8 / "
        "cpu-int4",
        "bnb_quantization": "its stacked experts have no bitsandbytes layer (they would stay float)",
        "int4_checkpoints": "the AWQ / GPTQ loader does not read packed expert tensors",
        "tensor_parallel": "its stacked experts are not sharded across ranks (no expert or tensor parallelism)",
    }
)

# Why Gemma 3 (text-only and the language model of a vision-language checkpoint) refuses what it does.
_GEMMA3_UNSUPPORTED: Mapping[str, str] = MappingProxyType(
    {
        "lora": "adapters on Gemma 3's layers are not checked against PEFT yet",
        "tensor_parallel": "its sharding is not checked against the single-device model yet",
        "gguf_quantized": "a Gemma 3 GGUF loads dequantized only (leave quantization unset)",
    }
)

ARCHITECTURE_INFO: dict[str, ArchitectureInfo] = {
    "LlamaForCausalLM": ArchitectureInfo("LlamaForCausalLM", "llama", ("llama",)),
    "MistralForCausalLM": ArchitectureInfo("MistralForCausalLM", "llama", ("mistral",)),
    "Qwen2ForCausalLM": ArchitectureInfo("Qwen2ForCausalLM", "qwen", ("qwen2",)),
    "Qwen3ForCausalLM": ArchitectureInfo("Qwen3ForCausalLM", "qwen", ("qwen3",)),
    "Phi3ForCausalLM": ArchitectureInfo(
        "Phi3ForCausalLM",
        "phi",
        ("phi3",),
        unsupported={
            "lora": "adapters target the fused qkv_proj / gate_up_proj, which the LoRA layers do not split",
            "int4_checkpoints": "AWQ / GPTQ pack the fused projections, which the int4 loader does not split",
        },
    ),
    "MixtralForCausalLM": ArchitectureInfo("MixtralForCausalLM", "mixtral", ("llama",), _MOE_UNSUPPORTED),
    "Qwen3MoeForCausalLM": ArchitectureInfo("Qwen3MoeForCausalLM", "qwen", ("qwen3moe",), _MOE_UNSUPPORTED),
    "Gemma3ForCausalLM": ArchitectureInfo("Gemma3ForCausalLM", "gemma", ("gemma3",), _GEMMA3_UNSUPPORTED),
    "Gemma3ForConditionalGeneration": ArchitectureInfo(
        "Gemma3ForConditionalGeneration", "gemma", unsupported=_GEMMA3_UNSUPPORTED
    ),
}


def features_in_use(config: EngineConfig) -> list[str]:
    """The features of :data:`FEATURES` an engine config turns on."""
    used = {
        "prefix_caching": config.enable_prefix_caching,
        "cuda_graphs": str(config.device).startswith("cuda") and not config.enforce_eager,
        "fp8_kv_cache": str(config.kv_cache_dtype).startswith("fp8"),
        "speculative_decoding": config.speculative_config is not None,
        "lora": config.enable_lora,
        "fp8_weights": config.quantization == "fp8",
        "bnb_quantization": str(config.quantization).startswith("bnb-"),
        "cpu_quantization": config.quantization in ("cpu-int8", "cpu-int4"),
        "int4_checkpoints": False,  # known only once the checkpoint's config is read: the loader asks
        "gguf_quantized": False,  # known only once the model path is found to be a GGUF: the loader asks
        "tensor_parallel": config.tensor_parallel_size > 1,
    }
    return [name for name, on in used.items() if on]


def check_features(info: ArchitectureInfo, config: EngineConfig) -> None:
    """Refuse, by name, the first feature ``config`` turns on that the architecture cannot run with."""
    for feature in features_in_use(config):
        info.refuse(feature)


def features_table_markdown() -> str:
    """docs/models.md's table: one row per architecture, its GGUF names and each feature (yes / no: why)."""
    header = ["Architecture", "Family", "GGUF", *FEATURES.values()]
    rows = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    for info in ARCHITECTURE_INFO.values():
        cells = [f"`{info.hf_name}`", info.family, ", ".join(f"`{g}`" for g in info.gguf_names) or "no"]
        cells += ["yes" if info.supports(f) else f"no: {info.unsupported[f]}" for f in FEATURES]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
