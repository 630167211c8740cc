"""INT4 AWQ / GPTQ checkpoints through the engine, on folders the test packer writes from the tiny
random models: the packed tensors stand for the float weights (cross-checked by dequantizing), the
engine reads them into ``Int4Linear`` exactly, and its logits and greedy tokens match the same
model with the dequantized float weights. Unsupported configs are refused by name."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.quantization import Int4Linear, weight_memory_bytes
from gpu_workers.engine.quantization.int4_config import parse_int4_config
from gpu_workers.engine.quantization.int4_formats import awq_to_engine, dequantize, gptq_to_engine

from .int4_packer import pack_awq, pack_gptq, quantize_groups, write_int4_checkpoint
from .test_engine_quantized import engine_logits

# (model variant, method, packer options): every architecture and every supported GPTQ variant.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-awq": ("llama", "awq", {}),
    "qwen2-awq": ("qwen2", "awq", {"group_size": 64}),
    "mistral-gptq-asym": ("mistral", "gptq", {}),
    "llama-gptq-sym-actorder": ("llama", "gptq", {"sym": True, "desc_act": True}),
    "qwen2-gptq-v2-perchannel": ("qwen2", "gptq", {"group_size": -1, "checkpoint_format": "gptq_v2"}),
    "llama3_tied-gptq-actorder": ("llama3_tied", "gptq", {"desc_act": True}),
}


@pytest.fixture(scope="module")
def int4_dirs(
    model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("int4")
    built: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in built:
            variant, method, opts = CASES[case]
            built[case] = write_int4_checkpoint(model_dir(variant), root / case, method, **opts)
        return built[case]

    return get


@pytest.mark.parametrize("sym", [False, True])
def test_packer_codes_stand_for_the_float_weights(sym: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.1
    q = quantize_groups(w, 32, sym=sym, order=torch.randperm(64))
    # Round-to-nearest: a weight is within half a step (its group's scale) of its code's value, or
    # within one step where the rounded zero point pushed it onto the clamp at 0 or 15.
    step = q.scales[q.g_idx.long()].t().float() * 1.001 + 1e-6
    error = (q.dequantize() - w).abs()
    interior = (q.codes > 0) & (q.codes < 15)
    assert (error[interior] <= step[interior] / 2).all() and (error <= step).all()
    assert q.codes.min() >= 0 and q.codes.max() <= 15
    assert len(set(q.g_idx.tolist())) == 2 and (q.g_idx.bincount() == 32).all()


def test_engine_layout_dequantizes_awq_and_gptq_exactly() -> None:
    torch.manual_seed(1)
    w = torch.randn(40, 64) * 0.1
    q = quantize_groups(w, 16, sym=False, order=None)
    awq = awq_to_engine("x", **pack_awq(q), cfg=parse_int4_config({"quant_method": "awq", "group_size": 16}))
    got = dequantize(*awq, None, torch.float32)
    torch.testing.assert_close(got.t(), q.dequantize(), rtol=0, atol=0)

    perm = torch.randperm(64)
    q = quantize_groups(w, 16, sym=False, order=perm)
    cfg = parse_int4_config({"quant_method": "gptq", "group_size": 16, "desc_act": True})
    packed = pack_gptq(q)
    qweight, zeros, scales, g_idx = gptq_to_engine("x", **packed, cfg=cfg)
    assert torch.equal(qweight, packed["qweight"])  # GPTQ's qweight is the engine's layout as is
    torch.testing.assert_close(dequantize(qweight, zeros, scales, g_idx, torch.float32).t(), q.dequantize())


def _prompts() -> list[list[int]]:
    rng = random.Random(19)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 23, 70)]


@pytest.mark.parametrize("case", list(CASES))
def test_int4_engine_matches_dequantized_model(
    case: str,
    int4_dirs: Callable[[str], tuple[Path, Path]],
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
) -> None:
    int4_dir, ref_dir = int4_dirs(case)
    llm = make_llm(int4_dir, num_kv_blocks=48)
    ref = make_llm(ref_dir, num_kv_blocks=48)
    model = llm.engine.loaded.model
    assert [type(m) for m in model.modules() if type(m) is torch.nn.Linear] == [torch.nn.Linear]  # lm_head
    int4_layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4_layers) == 4 * len(model.model.layers)

    # The loaded INT4 layers hold exactly the dequantized reference weights (merged as the model merges them).
    ref_qkv = ref.engine.loaded.model.model.layers[0].self_attn.qkv_proj.weight
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj.dequantized_weight(), ref_qkv)

    prompts = _prompts()
    got = torch.cat([engine_logits(llm, p) for p in prompts])
    want = torch.cat([engine_logits(ref, p) for p in prompts])
    cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    with capsys.disabled():
        print(f"\n{case}: engine logits cosine vs the dequantized model = {cosine:.6f}")
    assert cosine >= 0.999, f"{case}: logits cosine {cosine:.6f}"

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens == [o.token_ids for o in ref.generate(prompts, params)]


def test_int4_weights_take_under_a_third_of_bf16(int4_dirs: Callable[[str], tuple[Path, Path]]) -> None:
    llm = LLM(str(int4_dirs("llama-awq")[0]), max_model_len=128, num_kv_blocks=8)
    layers = [m for m in llm.engine.loaded.model.modules() if isinstance(m, Int4Linear)]
    int4_bytes = sum(weight_memory_bytes(m) for m in layers)
    bf16_bytes = sum(2 * m.in_features * m.out_features for m in layers)
    # Group 32 on these tiny layers costs 4.75 bits a weight with fp32 scales on CPU (scale 32 bits /32,
    # zero 8 bits /32); group 128 with bf16 scales (benchmarks/int4_memory.py) comes to ~0.27x.
    assert int4_bytes / bf16_bytes <= 0.36


def _write_config(folder: Path, quantization_config: dict[str, Any]) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


@pytest.mark.parametrize(
    ("qcfg", "message"),
    [
        ({"quant_method": "awq", "bits": 8, "group_size": 32}, "bits=8"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits=3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "GEMM"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, "zero_point"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["down_proj"]}, "modules_to"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 30}, "multiple of 8"),
    ],
)
def test_unsupported_int4_configs_are_refused(
    qcfg: dict[str, Any], message: str, int4_dirs: Callable[[str], tuple[Path, Path]]
) -> None:
    folder = int4_dirs("llama-awq")[0]
    original = (folder / "config.json").read_text()
    try:
        _write_config(folder, qcfg)
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), max_model_len=128, num_kv_blocks=8)
    finally:
        (folder / "config.json").write_text(original)


def test_quantization_setting_must_agree_with_the_checkpoint(
    int4_dirs: Callable[[str], tuple[Path, Path]], model_dir: Callable[[str], Path]
) -> None:
    awq_dir = int4_dirs("llama-awq")[0]
    with pytest.raises(ValueError, match="already quantized with awq"):
        LLM(str(awq_dir), quantization="gptq", max_model_len=128, num_kv_blocks=8)
    with pytest.raises(ValueError, match="has none"):
        LLM(str(model_dir("llama")), quantization="awq", max_model_len=128, num_kv_blocks=8)
    llm = LLM(str(awq_dir), quantization="awq", max_model_len=128, num_kv_blocks=8)
    assert any(isinstance(m, Int4Linear) for m in llm.engine.loaded.model.modules())


def test_checkpoint_missing_a_packed_tensor_is_refused(
    int4_dirs: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    src = int4_dirs("mistral-gptq-asym")[0]
    for item in src.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys() if n != "model.layers.1.self_attn.k_proj.qzeros"}
    save_file(kept, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing INT4 tensors.*layers\.1\.self_attn\.qkv_proj"):
        LLM(str(tmp_path), max_model_len=128, num_kv_blocks=8)


def test_int4_methods_are_checkpoint_only(model_dir: Callable[[str], Path]) -> None:
    from gpu_workers.engine.quantization import check_quantization_supported, quantize_model

    check_quantization_supported("gptq", torch.device("cpu"))  # the torch fallback runs anywhere
    with pytest.raises(ValueError, match="awq, gptq"):
        check_quantization_supported("int4", torch.device("cpu"))
    llm = LLM(str(model_dir("llama")), max_model_len=128, num_kv_blocks=8)
    with pytest.raises(ValueError, match="come quantized in the checkpoint"):
        quantize_model(llm.engine.loaded.model, "awq")


def test_sharded_int4_checkpoint_loads_pieces_from_different_files(
    int4_dirs: Callable[[str], tuple[Path, Path]], make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    src, ref_dir = int4_dirs("qwen2-awq")
    for item in src.iterdir():
        if item.suffix != ".safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    # Alternate tensors between two shards, so q/k/v pieces (and qweight/scales) of one merged
    # projection arrive from different files.
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    llm = make_llm(tmp_path, num_kv_blocks=48)
    ref = make_llm(ref_dir, num_kv_blocks=48)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts()
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ref.generate(prompts, params)]
