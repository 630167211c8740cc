"""Model folders, KV-cache sizing and construction-time errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.attention import TorchAttentionBackend, get_attention_backend
from gpu_workers.engine.config import EngineConfig, parse_dtype
from gpu_workers.engine.execution.model_runner import kv_bytes_per_block
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .conftest import MODEL_VARIANTS, HFReference, random_prompts


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_sharded_checkpoint_loads_identically(
    tmp_path: Path, model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", **MODEL_VARIANTS["qwen2"], max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    prompts = random_prompts(seed=3)[4:8]
    llm = make_llm(sharded)
    outputs = llm.generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])
    reference = model_dir("qwen2")  # same arch and seed, one file
    for out, (prompt, n) in zip(outputs, prompts, strict=True):
        assert out.token_ids == hf_reference.greedy(reference, prompt, n)


def test_kv_cache_too_small_for_one_request_is_a_construction_error(
    model_dir: Callable[[str], Path],
) -> None:
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=512"):
        LLM(str(model_dir("llama")), num_kv_blocks=8, max_model_len=512)
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(str(model_dir("llama")), cpu_kv_cache_gb=1e-5, max_model_len=512)


def test_kv_cache_sized_from_cpu_share(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(model_dir("llama"), num_kv_blocks=None, cpu_kv_cache_gb=0.002, max_num_seqs=64)
    engine = llm.engine
    per_block = kv_bytes_per_block(engine.loaded, 16)
    assert engine.num_total_blocks == int(0.002 * (1 << 30)) // per_block
    # The auto size never exceeds what max_num_seqs full-length sequences can use.
    capped = make_llm(model_dir("llama"), num_kv_blocks=None, max_num_seqs=2)
    assert capped.engine.num_total_blocks == 2 * 512 // 16


def test_request_longer_than_max_model_len_is_rejected(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("llama"), num_kv_blocks=20, max_model_len=320)
    with pytest.raises(ValueError, match="exceeds max_model_len=320"):
        llm.generate([5] * 300, _greedy(21))
    with pytest.raises(ValueError, match="no room"):
        llm.generate([5] * 320, SamplingParams(max_tokens=None))
    # max_tokens=None fills the context.
    out = llm.generate([5] * 310, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_bad_model_folders(tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    broken = tmp_path / "gpt2"
    shutil.copytree(model_dir("llama"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(broken))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir("llama"), no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(no_weights))
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        LLM(str(model_dir("llama")), max_model_len=4096)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"dtype": "int8"}, "dtype"),
        ({"attention_backend": "xformers"}, "attention_backend"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_engine_config(model_dir: Callable[[str], Path], kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=match):
        EngineConfig(model=str(model_dir("llama")), **kwargs)


def test_attention_backend_selection() -> None:
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    try:
        from gpu_workers.engine.attention.triton_kernels import INTERPRETED
    except ImportError:  # no triton installed: the backend is unavailable by name
        INTERPRETED = False
    if INTERPRETED:  # the test session runs Triton's interpreter, which accepts CPU tensors
        assert get_attention_backend("triton", "cpu").name == "triton"
    else:
        with pytest.raises(ValueError, match="triton"):
            get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="flash_attn"):
        get_attention_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("paged", "cpu")


def test_dtype_parsing_and_bf16_on_cpu(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    assert parse_dtype("auto") is None
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    llm = make_llm(model_dir("llama"), dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.loaded.dtype is torch.bfloat16
    assert llm.engine.runner.kv_cache is not None and llm.engine.runner.kv_cache.dtype is torch.bfloat16
    out = llm.generate([random_prompts(seed=1)[5][0]], _greedy(6))[0]
    assert len(out.token_ids) == 6
    assert make_llm(model_dir("llama")).engine.loaded.dtype is torch.float32  # auto on CPU


def test_tiny_model_folder_is_a_normal_hf_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = make_tiny_model(tmp_path / "m", arch="mistral", num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3)
    config = AutoConfig.from_pretrained(str(path))
    assert config.architectures == ["MistralForCausalLM"] and config.num_hidden_layers == 3
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == config.vocab_size == 512
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "user: hi" in chat and chat.endswith("assistant:")
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")


def test_quantization_is_checked_before_loading(model_dir: Callable[[str], Path]) -> None:
    # The quantization package validates the method name; the loader must surface its error.
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(model_dir("llama")), quantization="int3")


def test_profile_forward_runs_without_touching_a_real_cache(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    # The CUDA sizing pass (a full-budget forward against a throw-away one-block cache, every slot
    # -1) must work with any backend input layout; run it on CPU, then restore the real cache.
    llm = make_llm(model_dir("llama"), num_kv_blocks=64)
    runner = llm.engine.runner
    runner._profile_forward(num_tokens=700, max_model_len=512)
    assert runner.kv_cache is None
    runner.allocate_kv_cache(64)
    out = llm.generate([random_prompts(seed=2)[6][0]], _greedy(5))[0]
    assert len(out.token_ids) == 5
