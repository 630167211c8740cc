"""Gemma 3 decoder (``Gemma3ForCausalLM``, the text-only 1B, and the language model of the multimodal
``Gemma3ForConditionalGeneration`` 4B-27B checkpoints) over the same flat token batches as ``llama.py``.

Where it differs from Llama: RMSNorms scale by ``1 + weight`` in float32; each block norms its attention and
MLP outputs too (pre- and post-norms); queries and keys get a per-head RMSNorm before rotary; attention scales
by ``query_pre_attn_scalar ** -0.5``; embeddings are multiplied by ``sqrt(hidden_size)``; the MLP is GeGLU
(``gelu_pytorch_tanh``); layers alternate sliding-window and full attention (``config.layer_types``), with a
RoPE of their own kind each (``rope_parameters["sliding_attention"]`` at the local base,
``["full_attention"]`` at the global base with its scaling); logits may be soft-capped
(``final_logit_softcapping``). ``attn_logit_softcapping`` is read by transformers' Gemma 3 attention no more
than here (Gemma 3 replaced it with the q/k norms), so a config setting it is served as transformers serves it.

The full-attention layers need every KV block, the sliding ones only their window: the engine gives each kind
its own pool and block table (``core/kv_groups.py``; ``benchmarks/gemma3_sliding_kv.py`` measures the saving).

Of a multimodal checkpoint only the language model is loaded: its weights sit under ``language_model.``
(hub layout: ``language_model.model.*``; transformers 5 layout: ``model.language_model.*``), the vision tower
and projector are skipped, and prompts holding the image token are refused (``image_token_index``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..attention.metadata import AttentionMetadata
from .llama import AttentionSpec, LlamaAttention, LlamaForCausalLM, Rope, head_dim_of, layer_types_windows
from .rotary import RotaryEmbedding

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``, all in float32 and rounded once (as transformers' Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's per-head q/k norms and ``query_pre_attn_scalar`` scaling."""

    def __init__(self, config: PretrainedConfig, sliding_window: int | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, AttentionSpec(bias, bias, qk_norm=True, sliding_window=sliding_window))
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``, gate and up merged into one projection."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, sliding_window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.is_sliding = sliding_window is not None
        self.self_attn = Gemma3Attention(config, sliding_window)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, max_len: int, windows: list[int | None]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        head_dim = head_dim_of(config)
        # Global layers' RoPE (with its scaling) and the sliding layers' local-base one.
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_len, layer_type=FULL)
        self.rotary_emb_local = RotaryEmbedding(config, head_dim, max_len, layer_type=SLIDING)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, window) for window in windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale rounded to the weights' dtype first, as transformers' scaled embedding does.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        rope_global = self.rotary_emb(positions)
        rope_local = self.rotary_emb_local(positions)
        for layer in self.layers:
            x = layer(rope_local if layer.is_sliding else rope_global, x, meta)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's causal LM: tied embeddings by default, optional final logit soft-cap. The features it does not
    serve are refused at load by its ``architectures.py`` entry."""

    def __init__(self, config: PretrainedConfig, max_len: int) -> None:
        nn.Module.__init__(self)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__} with use_bidirectional_attention is not supported")
        self.config = config
        self.model = Gemma3Model(config, max_len, self.sliding_windows(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def sliding_windows(cls, config: PretrainedConfig) -> list[int | None]:
        return layer_types_windows(config)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", True))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# Where a multimodal checkpoint keeps its language model: hub layout, then transformers 5's.
_LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                      ("language_model.lm_head.", "lm_head."))  # fmt: skip
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 vision-language checkpoint, served text-only."""

    @classmethod
    def text_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        text = getattr(config, "text_config", None)
        if text is None:
            raise ValueError(f"{cls.__name__} config.json has no text_config")
        text.architectures = list(config.architectures or [cls.__name__])
        # Whether the LM head shares the embedding is the whole model's setting (transformers ties by it).
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        # The prompt token that stands for an image: refused at admission (no vision tower here).
        text.image_token_index = getattr(config, "image_token_index", None)
        return text

    def refused_prompt_tokens(self) -> dict[int, str]:
        image = getattr(self.config, "image_token_index", None)
        if image is None:
            return {}
        reason = f"images are not supported: {type(self).__name__} is served text-only (no vision tower)"
        return {int(image): reason}

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, ours in _LANGUAGE_PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name
