"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over flat, unpadded token batches.

Inputs are ``[num_tokens]`` ids and positions for every sequence of the step laid end to end;
attention goes through a pluggable backend over the paged KV cache. Q/K/V and gate/up projections
are merged into single ``nn.Linear`` layers (fewer, larger matmuls); quantization swaps those
``nn.Linear`` modules in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..attention.base import AttentionBackend
from ..attention.metadata import AttentionMetadata
from .rotary import RotaryEmbedding, apply_rotary

# Per-step RoPE tables (cos, sin), each [num_tokens, 1, head_dim], shared by all layers.
Rope = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def uniform_windows(config: PretrainedConfig) -> list[int | None]:
    """Every layer slides by the config's ``sliding_window`` when it has one (Mistral, Mixtral, Phi-3 and
    Qwen3-MoE: transformers masks all their layers to it), else None each."""
    window = getattr(config, "sliding_window", None)
    return [int(window) if window else None] * config.num_hidden_layers


def layer_types_windows(config: PretrainedConfig) -> list[int | None]:
    """Per layer, the sliding window of a config that names its layers' kinds (``layer_types``, as
    transformers writes for Qwen2/Qwen3 with ``use_sliding_window`` and for Gemma 3), else None each."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or []
    if not window or len(kinds) != config.num_hidden_layers:
        return [None] * config.num_hidden_layers
    return [int(window) if kind == "sliding_attention" else None for kind in kinds]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference implementation."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm normalizes in float32 and rounds once to x's dtype, as transformers'
        # LlamaRMSNorm does before its weight multiply (bit for bit; one dispatch instead of six).
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's attention is built: projection biases, Qwen3's per-head q/k norms, and the
    layer's sliding window (keys seen per query, its own included; None: the whole context)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool = False
    sliding_window: int | None = None


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: AttentionSpec) -> None:
        super().__init__()
        qkv_bias, o_bias, qk_norm = spec.qkv_bias, spec.o_bias, spec.qk_norm
        self.sliding_window = spec.sliding_window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        # Qwen3's per-head RMSNorm of queries and keys, before rotary (one weight of head_dim shared by all heads).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # Bound by the model runner once the KV cache and backend exist.
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Per-KV-head scales of an FP8 cache (None otherwise), bound with it.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # The layer's KV group in a hybrid cache (``AttentionMetadata.for_group``); 0 otherwise.
        self.kv_group = 0

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # Queries and keys rotate together, as one [tokens, heads + kv_heads, head_dim] block: half
        # the small ops of rotating each (a decode step is dominated by such dispatch on a CPU).
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = apply_rotary(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.backend is None or self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer used before the model runner bound its KV cache")
        if self.kv_group:
            meta = meta.for_group(self.kv_group)
        out = self.backend.forward(
            q, k, v, self.k_cache, self.v_cache, meta, self.scale, k_scale=self.k_scale, v_scale=self.v_scale,
            sliding_window=self.sliding_window,
        )  # fmt: skip
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: AttentionSpec, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, spec)
        # ``mlp``: a model's own feed-forward block for this layer (a mixture of experts), else the dense one.
        self.mlp = mlp if mlp is not None else LlamaMLP(config, bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        max_len: int,
        specs: list[AttentionSpec],
        mlp_of: Callable[[int], nn.Module | None] = lambda layer: None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_len)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, spec, mlp=mlp_of(i)) for i, spec in enumerate(specs))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(rope, x, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Causal LM head over ``LlamaModel``; ``compute_logits`` runs only on the rows that sample."""

    def __init__(self, config: PretrainedConfig, max_len: int) -> None:
        super().__init__()
        self.config = config
        bias = bool(getattr(config, "attention_bias", False))
        specs = [
            AttentionSpec(self.qkv_bias(config), bias, self.qk_norm(config), window)
            for window in self.sliding_windows(config)
        ]
        self.model = LlamaModel(config, max_len, specs, mlp_of=lambda layer: self.mlp_of_layer(config, layer))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def qkv_bias(cls, config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @classmethod
    def qk_norm(cls, config: PretrainedConfig) -> bool:
        return False

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        """Per layer, how many positions its attention sees (None: the whole context)."""
        return layer_types_windows(config)

    @classmethod
    def mlp_of_layer(cls, config: PretrainedConfig, layer: int) -> nn.Module | None:
        """The feed-forward block of decoder layer ``layer``; None for the dense SiLU-gated MLP."""
        return None

    @classmethod
    def text_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        """The config of the language model (a multimodal checkpoint nests it)."""
        return config

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """This model's parameter name for a checkpoint tensor's, or None for a tensor it does not use."""
        return name

    def refused_prompt_tokens(self) -> dict[int, str]:
        """Prompt token ids this model cannot serve, each with the reason a request holding one is refused."""
        return {}

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral shares Llama's layout; with ``sliding_window`` set every layer attends only that many
    positions back (so the KV blocks behind the window are released: ``core/block_manager.py``)."""

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        return uniform_windows(config)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 adds biases to the Q/K/V projections (not to the output projection)."""

    @classmethod
    def qkv_bias(cls, config: PretrainedConfig) -> bool:
        return True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 normalizes each query and key head (RMSNorm over head_dim) before rotary; no Q/K/V biases
    unless its config asks for them (``attention_bias``)."""

    @classmethod
    def qk_norm(cls, config: PretrainedConfig) -> bool:
        return True
