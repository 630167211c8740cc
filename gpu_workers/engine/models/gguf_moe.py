"""The mixture-of-experts part of reading a GGUF (``gguf_convert.py``): a Mixtral GGUF is architecture ``llama``
with ``llama.expert_count`` set, a Qwen3-MoE one is ``qwen3moe``.

Expert tensors come stacked per projection (``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``,
``ffn_down_exps`` ``[E, H, I]``), or, in older Mixtral files, one per expert (``blk.N.ffn_gate.E``); the router is
``blk.N.ffn_gate_inp``. They keep those layouts in the converted folder, under names ``moe_checkpoint.py`` loads:
``mlp.experts.gate_proj.weight`` (stacked) or ``mlp.experts.E.gate_proj.weight``, and ``mlp.gate.weight``.
Under a CPU kept-quantized ``quantization`` the experts skip the folder's dequantized copies: ``gguf_quantized.py``
fills them from the file's own blocks (``quantization/cpu_experts.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import MixtralConfig, PretrainedConfig

# GGUF layer tensor -> Hugging Face name inside the layer, for the MoE tensors.
MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Older per-expert tensors, ``blk.N.ffn_gate.E.weight``.
_PER_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def is_moe(arch: str, field: Callable[[str, Any], Any]) -> bool:
    return int(field(f"{arch}.expert_count", 0) or 0) > 0


def moe_config(arch: str, field: Callable[[str, Any], Any], kwargs: dict[str, Any]) -> tuple[type, str, dict[str, Any]]:
    """(config class, HF architecture, config kwargs) of an MoE GGUF, from the dense kwargs ``build_config`` read."""
    experts = int(field(f"{arch}.expert_count", 0))
    used = int(field(f"{arch}.expert_used_count", 2))
    if arch == "qwen3moe":
        from transformers import Qwen3MoeConfig

        inter = int(field(f"{arch}.expert_feed_forward_length", kwargs["intermediate_size"]))
        # llama.cpp always renormalizes qwen3moe's chosen weights, as the released models' norm_topk_prob does.
        norm = bool(field(f"{arch}.expert_weights_norm", True))
        extra = dict(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=inter, norm_topk_prob=norm,
                     mlp_only_layers=[], decoder_sparse_step=1)  # fmt: skip
        return Qwen3MoeConfig, "Qwen3MoeForCausalLM", kwargs | extra
    return MixtralConfig, "MixtralForCausalLM", kwargs | dict(num_local_experts=experts, num_experts_per_tok=used)


def moe_expected_shapes(config: PretrainedConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The stacked expert tensors and router of one layer (``prefix``: ``model.layers.N.``)."""
    h = config.hidden_size
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    p = prefix + "mlp."
    return {
        p + "gate.weight": (experts, h),
        p + "experts.gate_proj.weight": (experts, inter, h),
        p + "experts.up_proj.weight": (experts, inter, h),
        p + "experts.down_proj.weight": (experts, h, inter),
    }


def per_expert_hf_name(parts: list[str], kind: str) -> str | None:
    """``blk.3.ffn_gate.5`` (split on dots) -> ``model.layers.3.mlp.experts.5.gate_proj.<kind>``; else None."""
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _PER_EXPERT and parts[3].isdigit():
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_PER_EXPERT[parts[2]]}.{kind}"
    return None


def stacked_of(name: str) -> tuple[str, int] | None:
    """A per-expert name's stacked name and expert: ``...experts.5.gate_proj.weight`` -> (``...experts.gate_proj
    .weight``, 5); None for other names."""
    head, sep, rest = name.partition(".mlp.experts.")
    expert, _, proj = rest.partition(".")
    if not sep or not expert.isdigit():
        return None
    return f"{head}.mlp.experts.{proj}", int(expert)
