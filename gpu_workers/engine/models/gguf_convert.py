"""Reads a GGUF with the ``gguf`` library and writes the Hugging Face folder ``gguf_checkpoint`` caches: config from
the metadata, every tensor dequantized by the library's own dequantizer (llama.cpp's Q/K row permutation undone
for llama/mistral, and the ``1 +`` llama.cpp folds into Gemma 3's norm weights: ``gguf_gemma3.py``), the
tokenizer with its chat template, and the generation config (an end-of-turn token, as Gemma's ``<end_of_turn>``,
ends generation too).

``phi3`` keeps its projections fused (``attn_qkv``; ``ffn_up`` holds gate and up) and so does the folder, under
transformers' Phi-3 names; its LongRoPE factors are the tensors ``rope_factors_long`` / ``rope_factors_short``,
which become the config's ``long_factor`` / ``short_factor``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import (
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from .gguf_errors import GGUFLoadError
from .gguf_gemma3 import GEMMA3_LAYER_TENSORS, gemma3_expected_shapes, gemma3_kwargs, unfold_norm
from .gguf_moe import MOE_LAYER_TENSORS, is_moe, moe_config, moe_expected_shapes, per_expert_hf_name, stacked_of

log = logging.getLogger(__name__)

T = GGMLQuantizationType
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K}
)
# GGUF architecture -> (config class, HF architecture name, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str, bool]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM", True),
    "mistral": (MistralConfig, "MistralForCausalLM", True),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", False),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", False),
    "phi3": (Phi3Config, "Phi3ForCausalLM", False),
    "qwen3moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", False),  # a llama file with experts is Mixtral: gguf_moe.py
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM", False),
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head query/key norms
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    **MOE_LAYER_TENSORS,
}
# Where an architecture's tensor means something else: phi3's ffn_up is gate and up, fused; gemma3's norms.
_ARCH_LAYER_TENSORS = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma3": GEMMA3_LAYER_TENSORS}
# LongRoPE factors (phi3): config values, not weights.
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
SHARD_BYTES = 2 << 30  # safetensors shard size: conversion holds at most about this much in memory
# Where each tensor's bytes lie in the GGUF (``tensor_index``), written beside the weights.
TENSOR_INDEX = "gguf_tensors.json"


def read_gguf(path: Path) -> GGUFReader:
    """Open a GGUF with the library's reader; a truncated or corrupt file is one ``GGUFLoadError``."""
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct/numpy errors on bad bytes
        raise GGUFLoadError(
            path, f"not a readable GGUF file (truncated or corrupt?): {type(exc).__name__}: {exc}"
        ) from exc


def _field(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFLoadError(reader.data.filename, f"metadata key {key!r} is missing")
        return default
    return field.contents()


def build_config(reader: GGUFReader, path: Path) -> PretrainedConfig:
    """The transformers config the GGUF's metadata describes (tied embeddings when it has no ``output``)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFLoadError(path, f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    config_cls, hf_arch, _ = ARCHITECTURES[arch]
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFLoadError(path, "per-dimension RoPE factors (rope_freqs, Llama 3.1 style scaling) are not supported")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise GGUFLoadError(path, f"partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFLoadError(path, "tensor 'token_embd.weight' is missing")
    vocab = int(_field(reader, f"{arch}.vocab_size", int(embed.shape[-1])))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 1e4))}
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(
                _field(reader, f"{arch}.rope.scaling.original_context_length")
            )
    elif scaling != "none":
        raise GGUFLoadError(path, f"RoPE scaling {scaling!r} is not supported (none, linear, yarn)")
    if rope_dim != head_dim:
        rope["partial_rotary_factor"] = rope_dim / head_dim
    if arch == "phi3":
        rope.update(_longrope(reader, path, arch, names))
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
    )
    if arch in ("mistral", "phi3"):
        # llama.cpp writes phi3's window as 0 where there is none (Phi-4).
        kwargs["sliding_window"] = _field(reader, f"{arch}.attention.sliding_window", None) or None
    if arch == "gemma3":
        kwargs.update(gemma3_kwargs(lambda key, default=...: _field(reader, key, default), kwargs))
    if "original_max_position_embeddings" in rope:
        kwargs["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if is_moe(arch, lambda key, default: _field(reader, key, default)):
        config_cls, hf_arch, kwargs = moe_config(arch, lambda key, default: _field(reader, key, default), kwargs)
    config = config_cls(**kwargs)
    config.architectures = [hf_arch]
    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    config.dtype = "float16" if types == {T.F16} else "float32" if types == {T.F32} else "bfloat16"
    return config


def _longrope(reader: GGUFReader, path: Path, arch: str, names: set[str]) -> dict[str, Any]:
    """A phi3 GGUF's LongRoPE parameters (none without its factor tensors): llama.cpp writes no scaling type for
    them, the original context length and the attention factor as metadata, the factors as two F32 tensors."""
    present = [n for n in ROPE_FACTOR_TENSORS if n in names]
    if not present:
        return {}
    if len(present) == 1:
        raise GGUFLoadError(path, f"LongRoPE needs both rope_factors_long and rope_factors_short; only {present[0]}")
    rope: dict[str, Any] = {"rope_type": "longrope"}
    for t in reader.tensors:
        if t.name in ROPE_FACTOR_TENSORS:
            rope[ROPE_FACTOR_TENSORS[t.name]] = [float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1)]
    original = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original is None:
        raise GGUFLoadError(
            path, f"LongRoPE factors without metadata key '{arch}.rope.scaling.original_context_length'"
        )
    rope["original_max_position_embeddings"] = int(original)
    attention_factor = _field(reader, f"{arch}.rope.scaling.attn_factor", None)
    if attention_factor is not None:
        rope["attention_factor"] = float(attention_factor)
    return rope


def expected_shapes(config: PretrainedConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name the config implies, with its ``[out, in]`` shape."""
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + "self_attn.o_proj.weight": (h, q)}
        if arch == "phi3":
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * inter, h)}
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h)}
            shapes |= {p + "self_attn.v_proj.weight": (kv, h)}
            if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
                shapes |= moe_expected_shapes(config, p)
            else:
                shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
                shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if arch == "gemma3":
            shapes |= gemma3_expected_shapes(config, p)
        if arch in ("qwen3", "qwen3moe"):
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    layer_tensors = _LAYER_TENSORS | _ARCH_LAYER_TENSORS.get(arch, {})
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    return per_expert_hf_name(parts, kind)


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: it interleaves each head's two rotary halves; HF keeps them apart."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_tensors(reader: GGUFReader, path: Path, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf name, tensor)`` for every tensor of the file, dequantized (F16/BF16 kept in their precision, every
    quantized type as float32), checked against the config's names and shapes before the first is yielded."""
    arch = _field(reader, "general.architecture")
    permuted = ARCHITECTURES[arch][2]
    expected = expected_shapes(config, arch)
    mapped: dict[str, Any] = {}
    for t in reader.tensors:
        if t.name in ROPE_FACTOR_TENSORS and arch == "phi3":
            continue  # read into the config's rope parameters
        name = hf_name(t.name, arch)
        stacked = stacked_of(name) if name is not None else None
        if name is not None and stacked is not None and stacked[0] in expected:
            # One expert of an older per-expert file: its shape is one of the stack's, and it stands for its part.
            stack, expert = stacked
            if expert < expected[stack][0]:
                expected[name] = expected[stack][1:]
                mapped.setdefault(stack, set()).add(expert)
        if name is None or name not in expected:
            raise GGUFLoadError(path, f"tensor {t.name!r} has no place in a {arch} model")
        if t.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(s.name for s in SUPPORTED_TYPES))
            raise GGUFLoadError(path, f"tensor {t.name!r} has type {t.tensor_type.name}, not supported ({supported})")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected[name]:
            raise GGUFLoadError(path, f"tensor {t.name!r} has shape {shape}, expected {expected[name]}")
        mapped[name] = t
    # A stack read expert by expert is there when all its experts are.
    stacks = {n: experts for n, experts in mapped.items() if isinstance(experts, set)}
    missing = sorted(set(expected) - set(mapped) | {n for n, e in stacks.items() if len(e) < expected[n][0]})
    if missing:
        raise GGUFLoadError(path, f"tensors missing: {missing[:4]}")
    for name, t in mapped.items():
        if name in stacks:
            continue
        try:
            values = dequantize(t.data, t.tensor_type)
        except Exception as exc:  # tensor bytes past the end of a truncated file, and similar
            raise GGUFLoadError(path, f"tensor {t.name!r} cannot be read: {type(exc).__name__}: {exc}") from exc
        values = np.ascontiguousarray(values) if values.flags.writeable else np.array(values)  # memmap views
        tensor = torch.from_numpy(values.reshape(expected[name]))
        if t.tensor_type == T.F16:
            tensor = tensor.to(torch.float16)
        elif t.tensor_type == T.BF16:
            tensor = tensor.to(torch.bfloat16)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = unpermute_rows(tensor, heads)
        if arch == "gemma3":
            tensor = unfold_norm(name, tensor)
        yield name, tensor.contiguous()


def _write_weights(reader: GGUFReader, path: Path, config: PretrainedConfig, out: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in read_tensors(reader, path, config):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _write_tokenizer(reader: GGUFReader, path: Path, out: Path) -> bool:
    """Tokenizer files built by transformers from the GGUF's metadata; True when it has a chat template."""
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if key not in reader.fields:
            raise GGUFLoadError(path, f"no tokenizer: metadata key {key!r} is missing")
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as exc:  # an unknown tokenizer model, inconsistent vocabulary, ...
        raise GGUFLoadError(path, f"tokenizer cannot be built: {type(exc).__name__}: {exc}") from exc
    tokenizer.save_pretrained(str(out))
    return bool(getattr(tokenizer, "chat_template", None))


def tensor_index(reader: GGUFReader) -> dict[str, Any]:
    """The architecture and, per tensor, its Hugging Face name, GGML type, ``[rows, cols]`` shape and byte range
    in the file: what the kept-quantized loader (``gguf_quantized.py``) needs to read a tensor's own blocks
    without parsing the file's metadata again (the tokenizer's arrays make that take seconds)."""
    arch = _field(reader, "general.architecture")
    tensors = [
        {
            "gguf_name": t.name,
            "name": hf_name(t.name, arch),
            "type": t.tensor_type.name,
            "shape": [int(d) for d in reversed(t.shape.tolist())],
            "offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    return {"architecture": arch, "tensors": tensors}


def convert(path: Path, out: Path) -> None:
    """Write the Hugging Face folder of the GGUF at ``path`` into ``out`` (an empty folder)."""
    reader = read_gguf(path)
    config = build_config(reader, path)
    (out / TENSOR_INDEX).write_text(json.dumps(tensor_index(reader)))
    has_template = _write_tokenizer(reader, path, out)
    if not has_template:
        log.warning("GGUF %s has no chat template: the model serves completions only", path)
    _write_weights(reader, path, config, out)
    config.save_pretrained(str(out))
    ids: dict[str, Any] = {k: getattr(config, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    ids["eos"] = end_token_ids(reader, ids["eos"])
    GenerationConfig(**{f"{k}_token_id": v for k, v in ids.items() if v is not None}).save_pretrained(str(out))


def end_token_ids(reader: GGUFReader, eos: int | None) -> int | list[int] | None:
    """The tokens that end generation: the file's EOS, its end-of-turn token (``eot_token_id``) and, for phi3,
    ``<|end|>`` found by its text, as llama.cpp finds it (Phi-3 ends each turn with it, not with its EOS)."""
    ends = [eos] if eos is not None else []
    eot = _field(reader, "tokenizer.ggml.eot_token_id", None)
    if eot is not None:
        ends.append(int(eot))
    if _field(reader, "general.architecture") == "phi3" and "tokenizer.ggml.tokens" in reader.fields:
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        if "<|end|>" in tokens:
            ends.append(tokens.index("<|end|>"))
    ends = list(dict.fromkeys(ends))
    return ends if len(ends) > 1 else (ends[0] if ends else None)
