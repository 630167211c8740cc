"""The Gemma 3 part of reading a GGUF (``gguf_convert.py``): llama.cpp's ``gemma3`` names, the settings it keeps in
code rather than in the file, and its folded norm scales.

- Tensors: ``ffn_norm`` is the norm before the MLP (not after attention, as in llama); the block's output norms
  are ``post_attention_norm`` and ``post_ffw_norm``.
- Config: the layer pattern (a period, or one flag per layer), the window, one RoPE per layer kind (the scaling in
  the file belongs to the global layers; the local base is llama.cpp's constant), the query scale (by head_dim,
  by hidden / heads for the 27B) and the final logit soft-cap.
- Weights: llama.cpp stores each norm's scale as ``1 + w``; the model adds the 1 itself, so it is taken off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PretrainedConfig

# Where a gemma3 layer tensor means something else than in llama.
GEMMA3_LAYER_TENSORS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp sets Gemma 3's local RoPE base and layer pattern in code, not in the metadata (newer files may say).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_PATTERN = 6
# The 27B model (62 layers) scales queries by hidden / heads, the others by head_dim, as llama.cpp decides.
GEMMA3_27B_LAYERS = 62


def gemma3_kwargs(field: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config settings beyond the Llama ones ``build_config`` read into ``kwargs``."""
    layers = kwargs["num_hidden_layers"]
    # A period (every n-th layer global), or one flag per layer (True: sliding), as gguf-py writes either.
    pattern = field("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    scalar = kwargs["head_dim"]
    if layers == GEMMA3_27B_LAYERS:
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return dict(
        sliding_window=int(field("gemma3.attention.sliding_window")),
        layer_types=["sliding_attention" if slides else "full_attention" for slides in sliding],
        rope_parameters={
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
        },
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=field("gemma3.final_logit_softcapping", None),
        hidden_activation="gelu_pytorch_tanh",
    )


def gemma3_expected_shapes(config: PretrainedConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """One layer's tensors beyond llama's (``prefix``: ``model.layers.N.``): the MLP's norms and the q/k norms."""
    h, hd = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        prefix + f"{n}.weight": (h,) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    }
    return shapes | {prefix + "self_attn.q_norm.weight": (hd,), prefix + "self_attn.k_norm.weight": (hd,)}


def unfold_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A gemma3 tensor as the model holds it: a norm scale without the ``1 +`` llama.cpp folded in."""
    return tensor - 1 if name.endswith("norm.weight") else tensor
