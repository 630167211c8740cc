"""GGUF checkpoints load through the engine's real path: an F32 GGUF gives exactly transformers' greedy tokens on
the original checkpoint; every quantized type loads as the ``gguf`` library's dequantization of what was written;
a folder holding one GGUF loads; the converted folder is cached and rebuilt when the file changes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoTokenizer, GenerationConfig

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.gguf_checkpoint import SOURCE_FILE, converted_folder, find_gguf
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.tokenizer import has_chat_template, load_tokenizer

from .conftest import MODEL_VARIANTS, HFReference, random_prompts
from .gguf_files import DEQUANTIZE_ONLY, GEMMA3_EOT_TOKEN, write_gguf

ARCHS = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral", seed=1),
    "qwen2": dict(arch="qwen2", seed=2),
    "qwen3": dict(arch="qwen3", seed=4, head_dim=32),
    "llama_tied": dict(arch="llama", seed=3, tie_word_embeddings=True, num_heads=8, num_kv_heads=2),
    # llama.cpp's phi3: fused attn_qkv and ffn_up, LongRoPE factors as tensors, partial rotary (Phi-4-mini).
    "phi3_longrope": MODEL_VARIANTS["phi3_longrope"],
    "phi4mini": MODEL_VARIANTS["phi4mini"],
}
# Types the gguf library quantizes (written from the model's weights) and, last, those it only dequantizes.
QUANTIZED = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, *DEQUANTIZE_ONLY]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("variant", list(ARCHS))
def test_f32_gguf_matches_transformers_on_the_original(
    variant: str, tmp_path: Path, hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    hf = make_tiny_model(tmp_path / "hf", **ARCHS[variant])
    write_gguf(hf, tmp_path / "model.gguf", T.F32)
    llm = make_llm(tmp_path / "model.gguf", dtype="float32")
    assert not (llm.engine.loaded.path / "lm_head.weight").exists()
    assert llm.engine.loaded.hf_config.tie_word_embeddings == bool(ARCHS[variant].get("tie_word_embeddings"))
    prompts = random_prompts(seed=len(variant))[:6]
    outputs = llm.generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])
    for out, (prompt, max_tokens) in zip(outputs, prompts, strict=True):
        assert out.token_ids == hf_reference.greedy(hf, prompt, max_tokens)
    # The tokenizer built from the GGUF's metadata is the original one, chat template included.
    original, rebuilt = AutoTokenizer.from_pretrained(str(hf)), llm.tokenizer
    text = "The river ran quietly past 2026 mills & 3.14 bakers.\nShe asked: what time?"
    assert rebuilt.encode(text) == original.encode(text)
    assert rebuilt.chat_template == original.chat_template
    # Every end token of the original's generation config (Phi-3: <|end|> beside <|endoftext|>).
    eos = GenerationConfig.from_pretrained(str(hf)).eos_token_id
    assert llm.engine.eos_token_ids == frozenset(eos if isinstance(eos, list) else [eos])


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 values: every K-quant block (256) and every other type's (32) fits the projections."""
    root = tmp_path_factory.mktemp("gguf_quant")
    return make_tiny_model(root / "hf", hidden_size=256, intermediate_size=256, num_layers=1, num_heads=4)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_quantized_gguf_loads_as_the_library_dequantizes_it(
    qtype: T, quant_model: Path, tmp_path: Path, hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    """Q4_K, Q5_K and Q6_K are written as random blocks: the gguf library can only dequantize them."""
    expected = write_gguf(quant_model, tmp_path / "model.gguf", qtype)
    llm = make_llm(tmp_path / "model.gguf", dtype="float32")
    model = llm.engine.loaded.model
    params = dict(model.named_parameters())
    for name, want in expected.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if ".q_proj." in name or ".k_proj." in name or ".v_proj." in name:
            attn = model.model.layers[int(layer)].self_attn
            q, kv = attn.q_size, attn.kv_size
            start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[name.split(".")[-2]]
            got = attn.qkv_proj.weight[start : start + want.shape[0]]
        elif ".gate_proj." in name or ".up_proj." in name:
            inter = want.shape[0]
            merged = model.model.layers[int(layer)].mlp.gate_up_proj.weight
            got = merged[:inter] if ".gate_proj." in name else merged[inter:]
        else:
            got = params[name]
        np.testing.assert_array_equal(got.detach().numpy(), want, err_msg=name)
    if qtype not in DEQUANTIZE_ONLY:  # lossy, but near the original weights
        assert np.abs(expected["model.embed_tokens.weight"]).max() > 0.1
    # The engine runs them: greedy tokens equal transformers' on the converted (dequantized) folder.
    prompt = list(range(3, 40))
    out = llm.generate([prompt], _greedy(12))[0]
    assert out.token_ids == hf_reference.greedy(llm.engine.loaded.path, prompt, 12)


def test_a_folder_holding_one_gguf_loads_and_the_conversion_is_cached(
    tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    hf = make_tiny_model(tmp_path / "hf", num_layers=1)
    folder = tmp_path / "gguf"
    folder.mkdir()
    gguf_path = folder / "tiny.gguf"
    write_gguf(hf, gguf_path, T.Q8_0)
    assert find_gguf(folder) == gguf_path
    llm = make_llm(folder)
    converted = llm.engine.loaded.path
    assert converted == folder / "tiny.hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / name).is_file(), name
    assert llm.generate([[5, 6, 7]], _greedy(4))[0].token_ids
    # The process engine loads the tokenizer from the model argument itself (EngineConfig.tokenizer_path).
    assert load_tokenizer(gguf_path).get_vocab() == llm.tokenizer.get_vocab()
    weights_mtime = (converted / "model.safetensors").stat().st_mtime_ns
    assert converted_folder(gguf_path) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == weights_mtime  # reused, not rebuilt
    # A changed file (other size or mtime) is converted again.
    write_gguf(hf, gguf_path, T.F32)
    os.utime(gguf_path, ns=(weights_mtime + 10**9, weights_mtime + 10**9))
    assert converted_folder(gguf_path) == converted
    assert str(gguf_path.stat().st_size) in (converted / SOURCE_FILE).read_text()
    assert not [p for p in folder.iterdir() if p.name.startswith(".tiny.hf")]  # no temporary folder left


def test_a_folder_with_several_ggufs_is_refused(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"2 \.gguf files"):
        LLM(str(tmp_path))


def test_a_gguf_without_chat_template_loads_completions_only(tmp_path: Path, make_llm: Callable[..., LLM]) -> None:
    hf = make_tiny_model(tmp_path / "hf", num_layers=1)
    write_gguf(hf, tmp_path / "plain.gguf", chat_template=False)
    llm = make_llm(tmp_path / "plain.gguf")
    assert not has_chat_template(llm.tokenizer)
    assert llm.generate(["The river"], _greedy(3))[0].token_ids
    torch.testing.assert_close(
        llm.engine.loaded.model.model.embed_tokens.weight, make_llm(hf).engine.loaded.model.model.embed_tokens.weight
    )


def test_gemma3_gguf_matches_transformers_on_the_original(
    tmp_path: Path, hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    hf = make_tiny_model(tmp_path / "hf", **MODEL_VARIANTS["gemma3"])
    # llama.cpp scales Gemma 3's queries by head_dim (hidden / heads for the 27B): the original must agree.
    config = json.loads((hf / "config.json").read_text())
    config["query_pre_attn_scalar"] = config["head_dim"]
    (hf / "config.json").write_text(json.dumps(config))
    write_gguf(hf, tmp_path / "model.gguf", T.F32)
    llm = make_llm(tmp_path / "model.gguf", dtype="float32")
    loaded = llm.engine.loaded
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    assert loaded.sliding_windows == [48, None, 48]
    assert loaded.hf_config.rope_parameters["full_attention"]["factor"] == 8.0
    prompts = random_prompts(seed=11)[:6]  # up to 300 tokens: far past the window
    outputs = llm.generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])
    for out, (prompt, max_tokens) in zip(outputs, prompts, strict=True):
        assert out.token_ids == hf_reference.greedy(hf, prompt, max_tokens)
    # A chat turn's end (llama.cpp's EOT id) stops generation as EOS does.
    eot = llm.tokenizer.convert_tokens_to_ids(GEMMA3_EOT_TOKEN)
    assert llm.engine.eos_token_ids == frozenset({llm.tokenizer.eos_token_id, eot})


def test_gemma3_gguf_refuses_kept_quantized_weights(tmp_path: Path) -> None:
    hf = make_tiny_model(tmp_path / "hf", **MODEL_VARIANTS["gemma3"])
    write_gguf(hf, tmp_path / "model.gguf", T.Q8_0)
    with pytest.raises(ValueError, match="GGUF kept-quantized weights is not supported for Gemma3ForCausalLM"):
        LLM(str(tmp_path / "model.gguf"), quantization="cpu-int8", max_model_len=256, num_kv_blocks=32)
