"""Rotary position embeddings over flat token batches, with the scaling variants of the Llama family.

The inverse frequencies come from transformers' own RoPE initialisers, so ``default``, ``linear``
and ``llama3`` scaling match the reference implementation bit for bit. ``dynamic`` (NTK) scaling
equals the default inside ``max_position_embeddings``; beyond it each position uses the base that
NTK scaling derives for a sequence ending at that position. A config with one RoPE per layer kind
(Gemma 3: ``rope_parameters[layer_type]``, local and global bases) gets one table per kind.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_params_of(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The RoPE parameters of the config, or of one layer kind when it keeps them per kind."""
    params = getattr(config, "rope_parameters", None) or {}
    return params[layer_type] if layer_type is not None else params


def rope_type_of(config: PretrainedConfig, layer_type: str | None = None) -> str:
    return str(rope_params_of(config, layer_type).get("rope_type", "default"))


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _inverse_frequencies(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    rope_type = rope_type_of(config, layer_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("default", "dynamic"):
        return _default_inv_freq(float(rope_params_of(config, layer_type)["rope_theta"]), head_dim), 1.0
    init = ROPE_INIT_FUNCTIONS[rope_type]
    kind = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, attention_scaling = init(config, torch.device("cpu"), **kind)
    return inv_freq.float(), float(attention_scaling)


def build_cos_sin_cache(
    config: PretrainedConfig, head_dim: int, max_len: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float32 ``cos`` and ``sin`` tables of shape ``[max_len, head_dim]``."""
    inv_freq, scaling = _inverse_frequencies(config, head_dim, layer_type)
    positions = torch.arange(max_len, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    if rope_type_of(config, layer_type) == "dynamic" and max_len > config.max_position_embeddings:
        orig = config.max_position_embeddings
        params = rope_params_of(config, layer_type)
        factor = float(params["factor"])
        base = float(params["rope_theta"])
        seq_len = positions[orig:] + 1
        scaled_base = base * ((factor * seq_len / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq_per_pos = 1.0 / (scaled_base[:, None] ** exponents[None, :])
        freqs[orig:] = positions[orig:, None] * inv_freq_per_pos
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[num_tokens, heads, head_dim]`` rows (queries and keys side by side) by per-token
    ``[num_tokens, 1, head_dim]`` tables; ``signed_sin`` holds sin with its first half negated, so
    rotate-half is one swap of the halves (the same products as negating them, exactly)."""
    half = x.shape[-1] // 2
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
        self.max_len = max_len
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", torch.empty(max_len, head_dim), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_len, head_dim), persistent=False)

    def reset_cache(self, dtype: torch.dtype) -> None:
        """(Re)compute the tables on the module's device; the loader calls this after placing weights."""
        cos, sin = build_cos_sin_cache(self.config, self.head_dim, self.max_len, self.layer_type)
        device = self.cos_cache.device
        half = self.head_dim // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # apply_rotary's signed sin
        self.cos_cache = cos.to(device=device, dtype=dtype)
        self.sin_cache = sin.to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)
