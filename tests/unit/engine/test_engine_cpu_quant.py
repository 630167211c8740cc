"""Weights kept quantized on the CPU through the engine (``quantization`` ``gguf``, ``cpu-int4``, ``cpu-int8``):
GGUF files written from the tiny random models load into ``CpuInt4Linear`` / ``CpuInt8Linear`` holding the
file's own weights (up to the bfloat16 rounding of their scales), and generate what the engine does with the
same file dequantized to float; AWQ / GPTQ checkpoints repack; bad input is refused by name.

The kept layers run in bfloat16 (torch's CPU kernels are vectorized only there) and so does the model under
them (``dtype="auto"``); the reference is the dequantized engine in bfloat16. Both round the same activations;
what differs is the kernel's weight (the file's 4-bit codes exactly, with scale and zero rounded to bfloat16,
against each weight rounded to bfloat16) and its summation order: about 2^-9 of each weight either way. The
layers' weights are checked against the file's to that bound; the teacher-forced logits within cosine 0.999,
with a top-1 that differs only where the reference's own top two (nearly) tie: measured, 0 to 3 of 65
positions, at reference margins of 0 or one bfloat16 ulp (0.0156) against a median margin of 0.17. Greedy
sequences are not compared: on these random models with their flat next-token distributions such a near-tie
comes within a dozen tokens, and every later token then differs. (The mapping itself is exact in float32:
``quantization/test_cpu_kernels.py``.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.gguf_convert import TENSOR_INDEX
from gpu_workers.engine.models.gguf_errors import GGUFLoadError
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.quantization import CpuInt4Linear, CpuInt8Linear, cpu_linear
from gpu_workers.engine.quantization.cpu_w8a8 import CpuW8A8Linear

from .gguf_files import DEQUANTIZE_ONLY, write_gguf
from .int4_packer import write_int4_checkpoint
from .test_engine_quantized import engine_logits

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Q4_K blocks (256 wide) need rows of 256: the wider model of test_gguf_loading.py.
MODELS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", seed=2),
    "qwen3": dict(arch="qwen3", seed=4, head_dim=32),
    "llama_tied": dict(arch="llama", seed=3, tie_word_embeddings=True, num_heads=8, num_kv_heads=2),
    "wide": dict(hidden_size=256, intermediate_size=256, num_layers=1, num_heads=4),
}
MIN_COSINE = 0.999
MIN_TOP1 = 0.95
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("cpu_quant_models")
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_tiny_model(root / variant, **MODELS[variant])
        return built[variant]

    return get


def quant_prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 45)]


def _layers(llm: LLM) -> dict[str, nn.Module]:
    model = llm.engine.loaded.model
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in (*PROJECTIONS, "lm_head")}


def _file_weight(expected: dict[str, np.ndarray], name: str, tied: bool) -> torch.Tensor:
    """What the GGUF holds for the engine module ``name`` (the library's dequantization, merged as the model
    merges q/k/v and gate/up; a tied LM head is the embedding)."""
    if name == "lm_head":
        return torch.from_numpy(expected["model.embed_tokens.weight" if tied else "lm_head.weight"])
    prefix, kind = name.rsplit(".", 1)
    parts = [f"{prefix}.{p}.weight" for p in _MERGED.get(kind, (kind,))]
    return torch.cat([torch.from_numpy(expected[p]) for p in parts])


def _compare(kept: LLM, ref: LLM, capsys: pytest.CaptureFixture[str], label: str) -> None:
    """Teacher-forced logits of the same prompts (so one flip does not carry into every later position)."""
    prompts = quant_prompts()
    got = torch.cat([engine_logits(kept, p) for p in prompts])
    want = torch.cat([engine_logits(ref, p) for p in prompts])
    compare_logits(got, want, capsys, label)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert all(len(o.token_ids) == 12 for o in kept.generate(prompts, params))


def compare_logits(
    got: torch.Tensor, want: torch.Tensor, capsys: pytest.CaptureFixture[str], label: str, near_tie: float = 0.25
) -> None:
    """The kept engine's logits ``got`` against the reference's ``want``, position by position; where the top-1
    differs the reference's margin must be below ``near_tie`` of its median top-2 margin."""
    cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    flips = got.argmax(-1) != want.argmax(-1)
    # Where they differ: how far below the reference's top-1 the kept engine's choice sits in the reference.
    margins = want.max(-1).values[flips] - want[flips].gather(1, got.argmax(-1)[flips, None])[:, 0]
    top2 = want.topk(2).values
    typical_margin = (top2[:, 0] - top2[:, 1]).median().item()
    with capsys.disabled():
        print(
            f"\n{label}: vs the dequantized engine, logits cosine {cosine:.6f}, top-1 agreement {top1:.3f}, "
            f"max |logit diff| {(got - want).abs().max().item():.4f}, reference margins where the top-1 differs "
            f"{[round(m, 4) for m in margins.tolist()]} (median top-2 margin {typical_margin:.4f})"
        )
    assert cosine >= MIN_COSINE, f"{label}: logits cosine {cosine:.6f}"
    assert top1 >= MIN_TOP1, f"{label}: top-1 agreement {top1:.3f}"
    # Every disagreement is a near-tie of the reference (measured: ties and one bf16 ulp, 0.0156).
    assert (margins <= typical_margin * near_tie).all(), (label, margins.tolist(), typical_margin)


@pytest.mark.parametrize(
    ("variant", "qtype"),
    [("llama", T.Q4_0), ("qwen2", T.Q4_1), ("qwen3", T.Q4_0), ("llama_tied", T.Q4_1), ("wide", T.Q4_K)],
    ids=lambda v: v if isinstance(v, str) else v.name,
)
def test_kept_4bit_gguf_matches_the_dequantized_engine(
    variant: str,
    qtype: T,
    tiny: Callable[[str], Path],
    tmp_path: Path,
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = write_gguf(tiny(variant), tmp_path / "m.gguf", qtype)
    kept = make_llm(tmp_path / "m.gguf", quantization="gguf", num_kv_blocks=48)
    ref = make_llm(tmp_path / "m.gguf", dtype="bfloat16", num_kv_blocks=48)
    assert kept.engine.loaded.dtype == torch.bfloat16  # "auto" under a CPU kept-quantized method
    layers = _layers(kept)
    assert len(layers) == 4 * len(kept.engine.loaded.model.model.layers) + 1
    assert all(isinstance(m, CpuInt4Linear) for m in layers.values())  # the LM head too (tied: the embedding's)
    assert type(kept.engine.loaded.model.model.embed_tokens) is nn.Embedding
    for name, layer in layers.items():
        # The file's weights, merged and un-permuted as the float loader does, but for bf16 scales and zeros:
        # (q - 8) * s + z rounds s and z by 2^-9 each, |8 s| and |z| at most about twice the block's largest weight.
        want = _file_weight(expected, name, tied=variant == "llama_tied")
        held = layer.dequantized_weight()
        assert (held - want).abs().max() <= 2.0**-7 * want.abs().max(), name
    if qtype != T.Q4_K:  # random Q4_K blocks make a model whose logits say nothing
        _compare(kept, ref, capsys, f"{variant} {qtype.name}")


@pytest.mark.parametrize(("dense_dtype", "min_cosine"), [(torch.float32, 0.99999), (torch.bfloat16, 0.9999)])
def test_a_long_prefill_through_unpacked_weights_matches_the_kernel(
    dense_dtype: torch.dtype,
    min_cosine: float,
    tiny: Callable[[str], Path],
    tmp_path: Path,
    make_llm: Callable[..., LLM],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt past ``DENSE_MIN_ROWS`` prefills through the unpacked weights; the same prompt with the threshold
    out of reach goes through the int4 kernel. In a bfloat16 model both see the same bfloat16 inputs and round
    their float32 sums to bfloat16; unpacked into float32 (AVX2) the weights are the kernel's too, so the two differ
    by summation order only; unpacked into bfloat16 (AVX512_BF16) each weight is rounded once more."""
    monkeypatch.setattr(cpu_linear, "DENSE_PATH", True)
    monkeypatch.setattr(cpu_linear, "DENSE_DTYPE", dense_dtype)
    write_gguf(tiny("qwen2"), tmp_path / "m.gguf", T.Q4_1)
    kept = make_llm(tmp_path / "m.gguf", quantization="gguf", num_kv_blocks=48)
    prompt = [random.Random(5).randrange(3, 512) for _ in range(cpu_linear.DENSE_MIN_ROWS + 32)]
    unpacked = {"calls": 0}
    dense_mm = CpuInt4Linear._dense_mm

    def counted(layer: CpuInt4Linear, flat: torch.Tensor) -> torch.Tensor:
        unpacked["calls"] += 1
        return dense_mm(layer, flat)

    monkeypatch.setattr(CpuInt4Linear, "_dense_mm", counted)
    dense = engine_logits(kept, prompt)
    assert unpacked["calls"] == len(_layers(kept))  # every projection and the LM head (all positions' logits)
    monkeypatch.setattr(cpu_linear, "DENSE_MIN_ROWS", 10**9)
    kernel = engine_logits(kept, prompt)
    assert unpacked["calls"] == len(_layers(kept))
    cosine = F.cosine_similarity(dense.flatten(), kernel.flatten(), dim=0).item()
    assert cosine >= min_cosine, cosine
    assert (dense.argmax(-1) == kernel.argmax(-1)).float().mean().item() >= 0.99


def test_kept_q8_0_gguf_is_int8_per_channel(
    tiny: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], capsys: pytest.CaptureFixture[str]
) -> None:
    """Q8_0's 32-wide block scales become one scale per output channel (the kernel has no other): the
    requantization rounds each weight by at most half its row's step."""
    expected = write_gguf(tiny("llama"), tmp_path / "m.gguf", T.Q8_0)
    kept = make_llm(tmp_path / "m.gguf", quantization="gguf", num_kv_blocks=48)
    ref = make_llm(tmp_path / "m.gguf", dtype="bfloat16", num_kv_blocks=48)
    for name, layer in _layers(kept).items():
        assert isinstance(layer, CpuInt8Linear), name
        step = layer.scales.float()[:, None]
        want = _file_weight(expected, name, tied=False)
        assert ((layer.dequantized_weight() - want).abs() <= step / 2 + 1e-6).all(), name
    _compare(kept, ref, capsys, "llama Q8_0")


@pytest.mark.parametrize(("method", "qtype"), [("cpu-int4", T.Q4_1), ("gguf", T.Q4_1)])
def test_the_w8a8_lm_head_matches_the_dequantized_engine(
    method: str,
    qtype: T,
    tiny: Callable[[str], Path],
    tmp_path: Path,
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``lm_head_quantization="w8a8"`` over kept weights: the head (the tied embedding's float weight, or under
    ``gguf`` its 4-bit blocks dequantized) multiplies in integers, the embedding stays float, and the logits stay
    the dequantized engine's within the same bounds as the kept layers'. (A Q8_0 head's codes taken as they are:
    ``quantization/test_cpu_w8a8.py``.)"""
    write_gguf(tiny("llama_tied"), tmp_path / "m.gguf", qtype)
    kept = make_llm(tmp_path / "m.gguf", quantization=method, lm_head_quantization="w8a8", num_kv_blocks=48)
    ref = make_llm(tmp_path / "m.gguf", dtype="bfloat16", num_kv_blocks=48)
    model = kept.engine.loaded.model
    assert isinstance(model.lm_head, CpuW8A8Linear)
    assert type(model.model.embed_tokens) is nn.Embedding
    _compare(kept, ref, capsys, f"w8a8 head over {method} {qtype.name}")


def test_merged_pieces_of_different_types(
    tiny: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """q/k Q4_1 with v Q8_0 (as llama.cpp's mixes do): ``gguf`` leaves that qkv_proj float; ``cpu-int4`` and
    ``cpu-int8`` convert every projection (the LM head stays float); all three generate."""
    write_gguf(tiny("llama"), tmp_path / "m.gguf", T.Q4_1, types={"v_proj": T.Q8_0, "lm_head": T.F16})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = {
        "gguf": {"qkv_proj": nn.Linear, "o_proj": CpuInt4Linear, "lm_head": nn.Linear},
        "cpu-int4": {"qkv_proj": CpuInt4Linear, "down_proj": CpuInt4Linear, "lm_head": nn.Linear},
        "cpu-int8": {"qkv_proj": CpuInt8Linear, "gate_up_proj": CpuInt8Linear, "lm_head": nn.Linear},
    }
    for method, kinds in expected.items():
        llm = make_llm(tmp_path / "m.gguf", quantization=method, num_kv_blocks=32)
        for name, layer in _layers(llm).items():
            kind = name.rsplit(".", 1)[-1]
            if kind in kinds:
                assert type(layer) is kinds[kind], (method, name)
        assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4


def test_a_folder_converted_before_the_index_still_loads(
    tiny: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    write_gguf(tiny("llama"), tmp_path / "m.gguf", T.Q4_0)
    first = make_llm(tmp_path / "m.gguf", num_kv_blocks=32)
    index = first.engine.loaded.path / TENSOR_INDEX
    assert index.is_file()
    index.unlink()  # as a folder written by an older converter
    kept = make_llm(tmp_path / "m.gguf", quantization="gguf", num_kv_blocks=32)
    assert isinstance(kept.engine.loaded.model.lm_head, CpuInt4Linear)
    assert index.is_file()  # rebuilt from the GGUF once, then reused


@pytest.mark.parametrize("case", ["awq", "gptq"])
def test_int4_checkpoint_repacks_for_cpu_int4(
    case: str,
    tiny: Callable[[str], Path],
    tmp_path: Path,
    make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
) -> None:
    int4_dir, ref_dir = write_int4_checkpoint(tiny("qwen2"), tmp_path / case, case, group_size=64)
    kept = make_llm(int4_dir, quantization="cpu-int4", num_kv_blocks=48)
    layers = _layers(kept)
    assert all(isinstance(layers[n], CpuInt4Linear) for n in layers if n != "lm_head")
    assert type(layers["lm_head"]) is nn.Linear
    _compare(kept, make_llm(ref_dir, dtype="bfloat16", num_kv_blocks=48), capsys, f"qwen2 {case} -> cpu-int4")


def test_bad_input_is_refused_by_name(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    hf = tiny("llama")
    with pytest.raises(ValueError, match=r"quantization='gguf' keeps a GGUF file's own .* not a \.gguf file"):
        LLM(str(hf), quantization="gguf", max_model_len=64, num_kv_blocks=4)
    write_gguf(hf, tmp_path / "f16.gguf", T.F16)
    with pytest.raises(GGUFLoadError, match=r"keeps Q4_0, Q4_1, Q4_K, Q8_0 .* matrices are F16.*'cpu-int8'"):
        LLM(str(tmp_path / "f16.gguf"), quantization="gguf", max_model_len=64, num_kv_blocks=4)
    write_gguf(hf, tmp_path / "q5.gguf", T.Q5_0)
    with pytest.raises(GGUFLoadError, match=r"type Q5_0, not supported"):
        LLM(str(tmp_path / "q5.gguf"), quantization="gguf", max_model_len=64, num_kv_blocks=4)
    with pytest.raises(ValueError, match=r"quantization='cpu-int4' .* needs device='cpu', not 'cuda'"):
        LLM(str(tmp_path / "f16.gguf"), quantization="cpu-int4", device="cuda")
    act_order, _ = write_int4_checkpoint(hf, tmp_path / "act", "gptq", desc_act=True)
    with pytest.raises(ValueError, match=r"act-order"):
        LLM(str(act_order), quantization="cpu-int4", max_model_len=64, num_kv_blocks=4)
    with pytest.raises(ValueError, match=r"already quantized with gptq.*'cpu-int4'"):
        LLM(str(act_order), quantization="gguf", max_model_len=64, num_kv_blocks=4)


def test_k_quants_the_kernel_cannot_take_stay_float(
    tiny: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """Q4_K projections with Q6_K for v and down (a Q4_K_M-like mix): Q6_K stays float under ``gguf``."""
    assert T.Q6_K in DEQUANTIZE_ONLY
    write_gguf(tiny("wide"), tmp_path / "m.gguf", T.Q4_K, types={"v_proj": T.Q6_K, "down_proj": T.Q6_K})
    llm = make_llm(tmp_path / "m.gguf", quantization="gguf", num_kv_blocks=32)
    kinds = {n.rsplit(".", 1)[-1]: type(m) for n, m in _layers(llm).items()}
    assert kinds == {
        "qkv_proj": nn.Linear,
        "o_proj": CpuInt4Linear,
        "gate_up_proj": CpuInt4Linear,
        "down_proj": nn.Linear,
        "lm_head": CpuInt4Linear,
    }
