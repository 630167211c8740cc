"""Mixture-of-experts decoders: Mixtral (Llama attention) and Qwen3-MoE (Qwen3 attention, with its per-head
query/key norms), each layer's dense MLP replaced by ``moe.SparseMoeBlock``.

Qwen3-MoE may keep some layers dense, as transformers decides: a layer is sparse unless it is listed in
``mlp_only_layers``, and then only every ``decoder_sparse_step``-th layer (and only with ``num_experts`` > 0); a dense
layer's MLP has ``intermediate_size``, the experts ``moe_intermediate_size``.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from .llama import MistralForCausalLM, Qwen3ForCausalLM, uniform_windows
from .moe import SparseMoeBlock


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral: Mistral's attention (its sliding window, if set, slides every layer as Mistral's does), and every
    layer's MLP a top-2 (``num_experts_per_tok``) mixture of ``num_local_experts`` experts, routing weights
    renormalized over the chosen."""

    @classmethod
    def mlp_of_layer(cls, config: PretrainedConfig, layer: int) -> nn.Module | None:
        return SparseMoeBlock.for_mixtral(config)


def qwen3_moe_layer_is_sparse(config: PretrainedConfig, layer: int) -> bool:
    """Whether Qwen3-MoE's layer ``layer`` has experts (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    if layer in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return int(config.num_experts) > 0 and (layer + 1) % int(getattr(config, "decoder_sparse_step", 1)) == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention; sparse layers route each token to ``num_experts_per_tok`` of ``num_experts``
    experts (renormalized only under ``norm_topk_prob``); under ``use_sliding_window`` every layer slides (its
    config keeps ``sliding_window`` only then)."""

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        return uniform_windows(config)

    @classmethod
    def mlp_of_layer(cls, config: PretrainedConfig, layer: int) -> nn.Module | None:
        return SparseMoeBlock.for_qwen3_moe(config) if qwen3_moe_layer_is_sparse(config, layer) else None
