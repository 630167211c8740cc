"""Rotary position embeddings over flat token batches, with the scaling variants of the Llama family.

The inverse frequencies come from transformers' own RoPE initialisers, so ``default``, ``linear``
and ``llama3`` scaling match the reference implementation bit for bit. ``dynamic`` (NTK) scaling
equals the default inside ``max_position_embeddings``; beyond it each position uses the base that
NTK scaling derives for a sequence ending at that position. A config with one RoPE per layer kind
(Gemma 3: ``rope_parameters[layer_type]``, local and global bases) gets one table per kind.

``longrope`` (Phi-3 / Phi-4-mini) has two sets of per-frequency factors: transformers picks the long set
whenever the sequence in hand is longer than ``original_max_position_embeddings``, so a sequence that grows past
it mixes keys rotated one way in its cache with queries rotated the other. The engine picks one set for the
whole engine instead, from its context limit (the long set when ``max_model_len`` exceeds the original
length, as vLLM does): every cached key, shared prefix block and recomputed (preempted) sequence then agrees.
Set ``max_model_len`` to at most the original length to serve short contexts with the short factors.

``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the first fraction of each head; the tables then
have that many columns and ``apply_rotary`` passes the rest of the head through.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")


def rope_params_of(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The RoPE parameters of the config, or of one layer kind when it keeps them per kind."""
    params = getattr(config, "rope_parameters", None) or {}
    return params[layer_type] if layer_type is not None else params


def rope_type_of(config: PretrainedConfig, layer_type: str | None = None) -> str:
    return str(rope_params_of(config, layer_type).get("rope_type", "default"))


def rotary_dim_of(config: PretrainedConfig, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dimensions of each head rotate (transformers' rule: ``int(head_dim * factor)``)."""
    factor = float(rope_params_of(config, layer_type).get("partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(
            f"partial_rotary_factor={factor} gives {dim} rotary dimensions of head_dim={head_dim}; "
            "it must give an even number from 2 to head_dim"
        )
    return dim


def uses_long_factors(config: PretrainedConfig, max_len: int, layer_type: str | None = None) -> bool:
    """Whether a ``longrope`` model takes its long factors for an engine of context ``max_len`` (module docstring)."""
    params = rope_params_of(config, layer_type)
    return rope_type_of(config, layer_type) == "longrope" and max_len > int(params["original_max_position_embeddings"])


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _inverse_frequencies(
    config: PretrainedConfig, head_dim: int, max_len: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    rope_type = rope_type_of(config, layer_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    params = rope_params_of(config, layer_type)
    if rope_type in ("default", "dynamic"):
        return _default_inv_freq(float(params["rope_theta"]), rotary_dim_of(config, head_dim, layer_type)), 1.0
    kwargs: dict[str, object] = {} if layer_type is None else {"layer_type": layer_type}
    if uses_long_factors(config, max_len, layer_type):
        # transformers chooses the long factors for any sequence length past the original one.
        kwargs["seq_len"] = int(params["original_max_position_embeddings"]) + 1
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(attention_scaling)


def build_cos_sin_cache(
    config: PretrainedConfig, head_dim: int, max_len: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float32 ``cos`` and ``sin`` tables of shape ``[max_len, rotary_dim]``."""
    inv_freq, scaling = _inverse_frequencies(config, head_dim, max_len, layer_type)
    positions = torch.arange(max_len, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    if rope_type_of(config, layer_type) == "dynamic" and max_len > config.max_position_embeddings:
        orig = config.max_position_embeddings
        params = rope_params_of(config, layer_type)
        factor = float(params["factor"])
        base = float(params["rope_theta"])
        dim = 2 * inv_freq.shape[0]  # the rotary dimensions (all of head_dim unless partial)
        seq_len = positions[orig:] + 1
        scaled_base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq_per_pos = 1.0 / (scaled_base[:, None] ** exponents[None, :])
        freqs[orig:] = positions[orig:, None] * inv_freq_per_pos
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[num_tokens, heads, head_dim]`` rows (queries and keys side by side) by per-token
    ``[num_tokens, 1, head_dim]`` tables; ``signed_sin`` holds sin with its first half negated, so
    rotate-half is one swap of the halves (the same products as negating them, exactly). Tables narrower than
    the head (partial rotary) rotate its first columns and pass the rest through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, signed_sin), x[..., rot:]), dim=-1)
    half = rot // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped * signed_sin)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE tables; ``forward`` looks up one step's positions once for all layers."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_len: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.config = config
        # The layer kind whose RoPE parameters these tables follow, for configs that keep them per kind.
        self.layer_type = layer_type
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(config, head_dim, layer_type)
        self.max_len = max_len
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", torch.empty(max_len, self.rotary_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_len, self.rotary_dim), persistent=False)

    def reset_cache(self, dtype: torch.dtype) -> None:
        """(Re)compute the tables on the module's device; the loader calls this after placing weights."""
        cos, sin = build_cos_sin_cache(self.config, self.head_dim, self.max_len, self.layer_type)
        device = self.cos_cache.device
        half = self.rotary_dim // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # apply_rotary's signed sin
        self.cos_cache = cos.to(device=device, dtype=dtype)
        self.sin_cache = sin.to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)
