"""Writes GGUF files from tiny Hugging Face checkpoints with ``gguf.GGUFWriter``, the way llama.cpp's converter
lays them out (tensor names, Q/K row permutation for llama/mistral, tokenizer metadata), for the GGUF tests.

Types the ``gguf`` library can quantize are written from the real weights; the K-quants (Q4_K, Q5_K, Q6_K), which
it can only dequantize, are written as random blocks with small finite scales: the load is then checked against
the library's dequantization of those bytes, not against the original weights.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file
from transformers import AutoConfig

DEQUANTIZE_ONLY = (T.Q4_K, T.Q5_K, T.Q6_K)
# Byte offsets of the f16 scales in one block of each K-quant (the rest of a block may hold any bits).
_K_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    # Phi-3 checkpoints hold these fused, and so does llama.cpp's phi3 (ffn_up: gate and up).
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# The GGUF architecture of a transformers model type, where the names differ (a Mixtral GGUF is a llama one).
_GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3"}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Gemma 3's end-of-turn token, as llama.cpp writes it for the chat template (the tiny tokenizer's "<pad>").
GEMMA3_EOT_TOKEN = "<pad>"


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)", rest)
    if expert is not None:  # an older Mixtral GGUF's one tensor per expert: blk.N.ffn_gate.E
        return f"blk.{layer}.{names['mlp.' + expert[2]]}.{expert[1]}.{kind}"
    return f"blk.{layer}.{names[rest]}.{kind}"


def _write_gemma3_metadata(writer: gguf.GGUFWriter, config: AutoConfig, hf_dir: Path) -> None:
    """What llama.cpp's Gemma 3 converter adds: window, per-layer pattern, global RoPE scaling, soft-cap, EOT."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    scaling = config.rope_parameters["full_attention"]
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    writer.add_eot_token_id(vocab[GEMMA3_EOT_TOKEN])


def moe_tensors(tensors: dict[str, np.ndarray], num_experts: int, per_expert: bool) -> dict[str, np.ndarray]:
    """A MoE checkpoint's tensors as llama.cpp's converter writes them: the router as ``mlp.gate``, the experts
    stacked per projection (``mlp.experts.gate_proj.weight`` ``[E, I, H]``), or one per expert under Qwen3-MoE's
    names (``per_expert``: older Mixtral GGUFs)."""
    out: dict[str, np.ndarray] = {}
    for name, weight in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            name = re.sub(rf"(\.experts\.\d+)\.{old}\.", rf"\1.{new}.", name)
        out[name] = weight
    if per_expert:
        return out
    for name in [n for n in out if ".mlp.experts.0." in n]:
        head, _, proj = name.partition(".mlp.experts.0.")
        stack = [out.pop(f"{head}.mlp.experts.{e}.{proj}") for e in range(num_experts)]
        out[f"{head}.mlp.experts.{proj}"] = np.stack(stack)
    return out


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` Q/K permutation (interleaves the two rotary halves of each head)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def reverse_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``permute``, written as transformers' GGUF loader writes it."""
    return (
        weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)
    )


def _random_k_blocks(qtype: T, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scale = np.float16(rng.uniform(0.002, 0.01))
        raw[:, :, offset : offset + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return raw.reshape(shape[0], -1)


def _write_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, chat_template: bool) -> None:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    added = {t["id"]: t for t in data["added_tokens"]}
    vocab.update({t["content"]: i for i, t in added.items()})
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [
        (gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED) if i in added else 1
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config.get("bos_token") or "<s>"])
    writer.add_eos_token_id(vocab[config.get("eos_token") or "</s>"])
    writer.add_pad_token_id(vocab[config.get("pad_token") or "<pad>"])
    writer.add_add_bos_token(True)
    template = hf_dir / "chat_template.jinja"
    if chat_template and template.is_file():
        writer.add_chat_template(template.read_text())


def _write_phi3_rope(writer: gguf.GGUFWriter, config: Any) -> None:
    """As llama.cpp's converter writes a Phi-3: the window (0 for none), and for LongRoPE no scaling type but the
    original context, the attention factor it computes, and the factors as two F32 tensors."""
    writer.add_sliding_window(config.sliding_window or 0)
    rope = config.rope_parameters
    if rope.get("rope_type") != "longrope":
        return
    original = int(rope["original_max_position_embeddings"])
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: T = T.F32,
    *,
    arch: str | None = None,
    tokenizer: bool = True,
    chat_template: bool = True,
    seed: int = 0,
    types: dict[str, T] | None = None,
    per_expert: bool = False,
) -> dict[str, np.ndarray]:
    """Write ``out`` from the checkpoint in ``hf_dir``, every 2-D tensor whose rows fit ``qtype``'s blocks in
    ``qtype`` (the rest F32), and return what a loader must produce: the library's dequantization of every
    written tensor, back in Hugging Face names and row order. ``types``: another type for the tensors whose
    Hugging Face name contains a key (``{"v_proj": T.Q8_0}``), first match wins. A mixture-of-experts model's
    experts are written stacked (``ffn_gate_exps``), or one per expert with ``per_expert``."""
    config = AutoConfig.from_pretrained(str(hf_dir))
    arch = arch or _GGUF_ARCH.get(config.model_type, config.model_type)
    permuted = config.model_type in ("llama", "mistral", "mixtral")
    writer = gguf.GGUFWriter(str(out), arch)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
            # Absent, llama.cpp renormalizes qwen3moe's chosen weights; written, the checkpoint's own choice holds.
            writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3 keeps one RoPE per layer kind: the global one here
    writer.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if config.model_type == "phi3":
        _write_phi3_rope(writer, config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma3":
        _write_gemma3_metadata(writer, config, hf_dir)
    if tokenizer:
        _write_tokenizer(writer, hf_dir, chat_template)
    rng = np.random.default_rng(seed)
    expected: dict[str, np.ndarray] = {}
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if num_experts:
        tensors = moe_tensors(tensors, num_experts, per_expert)
    for name, weight in sorted(tensors.items()):
        weight = weight.astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight + 1  # llama.cpp stores Gemma's norm scales as 1 + w
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        if permuted and heads and name.endswith("weight"):
            weight = permute(weight, heads)
        wanted = next((t for key, t in (types or {}).items() if key in name), qtype)
        block = gguf.GGML_QUANT_SIZES[wanted][0]
        # Stacked experts [E, rows, cols] quantize along their rows as a matrix does.
        kind = wanted if weight.ndim in (2, 3) and weight.shape[-1] % block == 0 else T.F32
        if kind in DEQUANTIZE_ONLY:
            data = _random_k_blocks(kind, weight.shape, rng)
        else:
            data = gguf.quants.quantize(weight, kind)
        writer.add_tensor(gguf_name(name, arch), data, raw_dtype=kind)
        loaded = gguf.quants.dequantize(data, kind).reshape(weight.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            loaded = loaded - 1
        expected[name] = reverse_permute(loaded, heads) if permuted and heads and name.endswith("weight") else loaded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
