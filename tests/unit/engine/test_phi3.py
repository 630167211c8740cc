"""Phi-3 / Phi-4-mini specifics beyond the shared parity suite: LongRoPE against transformers unpinned (prompts
past the original length take the long factors there too; an engine whose context fits the original length takes
the short ones), the fused checkpoint tensors, the sliding window on every layer, features refused by name, the chat
template and both end tokens, and the CPU kept-quantized methods on the merged layers (a float checkpoint's, and
a GGUF's own fused blocks)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Phi3Config

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models import Phi3ForCausalLM
from gpu_workers.engine.models.loader import resolve_max_model_len
from gpu_workers.engine.quantization import CpuInt4Linear, CpuInt8Linear

from .gguf_files import write_gguf
from .test_engine_quantized import engine_logits

ORIGINAL = 64  # original_max_position_embeddings of the conftest Phi variants


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _transformers_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' own greedy continuations, its LongRoPE switching left as it is."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None
            )
        out.append(full[0, len(prompt) :].tolist())
    return out


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("variant", ["phi3_longrope", "phi4mini"])
def test_longrope_factor_sets_match_unpinned_transformers(
    variant: str, model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir(variant)
    # Every prompt is past the original length: transformers takes the long factors for all of it, as the engine
    # does with a context past the original length.
    long_prompts = _prompts([ORIGINAL + 1, 100, 180], seed=7)
    long_engine = make_llm(path, max_model_len=512)
    got = [o.token_ids for o in long_engine.generate(long_prompts, _greedy(24))]
    assert got == _transformers_greedy(path, long_prompts, 24)
    # Within the original length transformers keeps the short factors, as an engine whose context fits it does.
    short_prompts = _prompts([5, 30, 40], seed=8)
    short_engine = make_llm(path, max_model_len=ORIGINAL)
    got_short = [o.token_ids for o in short_engine.generate(short_prompts, _greedy(ORIGINAL - 40))]
    assert got_short == _transformers_greedy(path, short_prompts, ORIGINAL - 40)
    # The factor sets differ enough to change what is generated: the comparison above can fail.
    other = [o.token_ids for o in long_engine.generate(short_prompts, _greedy(ORIGINAL - 40))]
    assert other != got_short


def test_checkpoint_holds_fused_projections_and_a_wrong_one_is_refused(
    model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    src = model_dir("phi3_longrope")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in src.iterdir():
        if file.name != "model.safetensors":
            (bad / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} has 112 rows; the config implies 128"):
        LLM(str(bad), max_model_len=128, num_kv_blocks=16)


def test_phi3_mini_4k_window_slides_every_layer_and_keeps_the_context() -> None:
    """transformers masks Phi-3's attention to ``sliding_window``, so every layer slides (parity past the window:
    the ``phi3_sliding`` variant) and the context stays ``max_position_embeddings``."""
    config = Phi3Config(max_position_embeddings=4096, sliding_window=2047, num_hidden_layers=3)
    assert Phi3ForCausalLM.sliding_windows(config) == [2047] * 3
    assert resolve_max_model_len(config, None) == 4096
    assert resolve_max_model_len(config, 4096) == 4096
    # Phi-4's window is unset: full attention.
    assert Phi3ForCausalLM.sliding_windows(Phi3Config(num_hidden_layers=2)) == [None, None]


def test_lora_and_int4_checkpoints_are_refused_by_name(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    path = model_dir("phi3_longrope")
    with pytest.raises(ValueError, match=r"^LoRA is not supported for Phi3ForCausalLM: "):
        LLM(str(path), enable_lora=True, max_model_len=128, num_kv_blocks=16)
    awq = tmp_path / "awq"
    awq.mkdir()
    for file in path.iterdir():
        (awq / file.name).write_bytes(file.read_bytes())
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^AWQ / GPTQ quantization is not supported for Phi3ForCausalLM: "):
        LLM(str(awq), max_model_len=128, num_kv_blocks=16)


def test_chat_template_and_both_end_tokens(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(model_dir("phi3_longrope"))
    tokenizer = llm.tokenizer
    end, endoftext = tokenizer.convert_tokens_to_ids(["<|end|>", "<|endoftext|>"])
    assert llm.engine.eos_token_ids == frozenset({end, endoftext})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    for stop in (end, endoftext):
        # Pushed to the top, either end token finishes the turn (and is not part of the text).
        params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={stop: 100.0})
        out = llm.generate([text], params)[0]
        assert out.token_ids == [stop] and out.finish_reason == "stop" and out.text == ""


@pytest.mark.parametrize(("method", "layer_type"), [("cpu-int8", CpuInt8Linear), ("cpu-int4", CpuInt4Linear)])
def test_cpu_kept_quantized_methods_take_the_merged_layers(
    method: str, layer_type: type, model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("phi4mini")
    kept = make_llm(path, quantization=method, max_model_len=128, num_kv_blocks=16)
    ref = make_llm(path, dtype="bfloat16", max_model_len=128, num_kv_blocks=16)
    float_weights = load_file(str(path / "model.safetensors"))  # Phi's checkpoint names are the merged layers'
    layer = kept.engine.loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, layer_type) and isinstance(layer.mlp.gate_up_proj, layer_type)
    for module, layer in kept.engine.loaded.model.named_modules():
        if module.endswith(("qkv_proj", "gate_up_proj")):
            # Each merged layer holds the float model's merged weight up to its quantization step: a part copied
            # to the wrong rows would be off by about the weights' own size.
            want = float_weights[f"{module}.weight"]
            step = want.abs().max() / (7.5 if method == "cpu-int4" else 127.0)
            assert (layer.dequantized_weight().float() - want).abs().max() <= step, module
    prompt = _prompts([90], seed=9)[0]  # past the original length
    got, want = engine_logits(kept, prompt), engine_logits(ref, prompt)
    cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    # int8 per channel stays close to bfloat16 (4-bit groups on random weights move further: measured 0.96).
    assert cosine >= (0.999 if method == "cpu-int8" else 0.9), cosine
    assert len(kept.generate([prompt], _greedy(6))[0].token_ids) == 6


@pytest.mark.parametrize(("qtype", "layer_type"), [(T.Q4_0, CpuInt4Linear), (T.Q8_0, CpuInt8Linear)])
def test_a_phi3_gguf_keeps_its_fused_projections_quantized(
    qtype: T, layer_type: type, model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """llama.cpp's fused ``attn_qkv`` / ``ffn_up`` fill the merged layers whole from the file's own blocks."""
    expected = write_gguf(model_dir("phi4mini"), tmp_path / "m.gguf", qtype)
    kept = make_llm(tmp_path / "m.gguf", quantization="gguf", max_model_len=128, num_kv_blocks=16)
    config = kept.engine.loaded.hf_config
    assert config.rope_parameters["rope_type"] == "longrope" and config.rope_parameters["partial_rotary_factor"] == 0.75
    for module, layer in kept.engine.loaded.model.named_modules():
        if module.endswith(("qkv_proj", "gate_up_proj")):
            assert isinstance(layer, layer_type), module
            want = torch.from_numpy(expected[f"{module}.weight"])
            # The file's weights, but for the bfloat16 rounding of block scales (and int8's per-row requantization).
            assert (layer.dequantized_weight() - want).abs().max() <= 2.0**-6 * want.abs().max(), module
    assert len(kept.generate([_prompts([70], seed=3)[0]], _greedy(6))[0].token_ids) == 6
