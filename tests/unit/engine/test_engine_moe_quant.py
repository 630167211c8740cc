"""Mixture-of-experts weights kept quantized on the CPU (``quantization/cpu_experts.py``): the grouped experts
through per-expert int4 / int8 kernels against the float grouped path; a Mixtral / Qwen3-MoE GGUF's Q4_0 / Q4_1 /
Q8_0 experts kept as the file holds them (``gguf``), compared with the same file dequantized as the dense kept
layers are (``test_engine_cpu_quant.py``: the layers' weights to the bfloat16 rounding of their scales, the
teacher-forced logits by cosine, top-1 agreement and near-ties). A router's top-k is discontinuous: where the
bfloat16 differences flip an expert choice the two engines run different experts and that position's logits say
nothing of the kernels, so the logits are compared where both engines routed every layer alike, and every flip must
be a near-tie of the reference's router (measured: 3 of 65 positions flip, at gaps of 0 to 0.017 in routing
probability against a median gap of 0.044; the dequantized bfloat16 engine itself is at cosine 0.998 from float32
over all positions for the same reason). A flipped position still reaches later ones through attention, so a
top-1 difference there need not be a near-tie of the logits: it must lie within the median top-2 margin (measured:
0, 0.047 and 0.14 against a median of 0.17). A float MoE checkpoint's experts quantized at load
(``cpu-int4`` / ``cpu-int8``); what MoE still cannot run refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.moe import SparseMoeBlock, experts_torch, route
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.quantization import CpuInt4Linear, CpuInt8Linear, quantize_model
from gpu_workers.engine.quantization.cpu_experts import CpuQuantizedExperts

from .conftest import MODEL_VARIANTS
from .gguf_files import write_gguf
from .test_engine_cpu_quant import compare_logits, quant_prompts
from .test_engine_quantized import engine_logits

# llama.cpp's qwen3moe has experts in every layer (no mlp_only_layers).
_QWEN3_MOE = MODEL_VARIANTS["qwen3_moe"]
VARIANTS = {
    "mixtral": MODEL_VARIANTS["mixtral"],
    "qwen3_moe": _QWEN3_MOE | {"config_overrides": _QWEN3_MOE["config_overrides"] | {"mlp_only_layers": []}},
}
_PROJ = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def _experts(llm: LLM) -> dict[str, CpuQuantizedExperts]:
    model = llm.engine.loaded.model
    return {n: m.mlp.experts for n, m in model.model.layers.named_children() if isinstance(m.mlp, SparseMoeBlock)}


@pytest.mark.parametrize(("method", "kind"), [("cpu-int4", CpuInt4Linear), ("cpu-int8", CpuInt8Linear)])
def test_kept_experts_run_the_grouped_path_through_the_kernels(method: str, kind: type) -> None:
    """Tokens grouped by expert through each expert's kernel give what the float grouped path gives with the
    kernels' own (dequantized) weights, to the bfloat16 rounding of the activations the kernels run in."""
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter = 6, 64, 96
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    block = SparseMoeBlock(hidden, inter, experts, 2, True, act="silu")
    block.experts.gate_up_proj.data.copy_(gate_up)
    block.experts.down_proj.data.copy_(down)
    quantize_model(block, method, skip=lambda name: name == "gate")
    kept = block.experts
    assert isinstance(kept, CpuQuantizedExperts)
    assert all(isinstance(m, kind) for m in (*kept.gate_up_proj, *kept.down_proj))
    held_gate_up, held_down = kept.dequantized()
    if method == "cpu-int4":  # min-max over 16 levels: half a step, the step a fifteenth of the group's span
        spans = gate_up.reshape(experts, 2 * inter, -1, 32)
        step = (spans.amax(-1) - spans.amin(-1)).repeat_interleave(32, -1) / 15
        assert ((held_gate_up - gate_up).abs() <= step * 0.51 + 2.0**-8 * gate_up.abs().amax()).all()
    for tokens in (1, 8, 37):
        x = torch.randn(tokens, hidden, generator=gen)
        weights, ids = route(block.gate(x), 2, True)
        want = experts_torch(x.bfloat16().float(), held_gate_up, held_down, weights, ids)
        got = block(x)
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        assert cosine >= 0.9999, (tokens, cosine)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def _file_experts(expected: dict[str, np.ndarray], layer: str, proj: str) -> torch.Tensor:
    """What the GGUF holds for one layer's experts' ``proj``, stacked ``[E, rows, cols]``, gate rows then up."""
    parts = [torch.from_numpy(expected[f"model.layers.{layer}.mlp.experts.{p}.weight"]) for p in _PROJ[proj]]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize(
    ("variant", "qtype", "down", "per_expert"),
    [
        ("mixtral", T.Q4_0, T.Q4_0, False),
        ("mixtral", T.Q8_0, T.Q8_0, False),
        ("mixtral", T.Q4_1, T.Q4_1, True),  # an older file's one tensor per expert
        ("qwen3_moe", T.Q4_1, T.Q4_1, False),
        ("qwen3_moe", T.Q4_0, T.Q8_0, False),  # down in a wider type, as llama.cpp's mixes keep it
    ],
    ids=lambda v: v if isinstance(v, str) else v.name if isinstance(v, T) else "per_expert" if v else "stacked",
)
def test_kept_moe_gguf_matches_the_dequantized_engine(
    variant: str, qtype: T, down: T, per_expert: bool, tmp_path: Path, make_llm: Callable[..., LLM],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    hf = make_tiny_model(tmp_path / "hf", **VARIANTS[variant])
    expected = write_gguf(hf, tmp_path / "m.gguf", qtype, types={"experts.down_proj": down}, per_expert=per_expert)
    if per_expert:  # the file's per-expert tensors, stacked as the engine's experts hold them
        expected = {**expected, **_stacked(expected)}
    kept = make_llm(tmp_path / "m.gguf", quantization="gguf", num_kv_blocks=48)
    ref = make_llm(tmp_path / "m.gguf", dtype="bfloat16", num_kv_blocks=48)
    layers = _experts(kept)
    assert len(layers) == len(kept.engine.loaded.model.model.layers)
    kinds = {p: CpuInt8Linear if t == T.Q8_0 else CpuInt4Linear for p, t in (("gate_up", qtype), ("down", down))}
    for layer, experts in layers.items():
        assert isinstance(experts, CpuQuantizedExperts), layer
        assert not list(experts.parameters())  # no float copy of the experts is held
        for proj, held in zip(("gate_up", "down"), experts.dequantized(), strict=True):
            assert all(isinstance(m, kinds[proj]) for m in getattr(experts, f"{proj}_proj"))
            want = _file_experts(expected, layer, proj)
            if kinds[proj] is CpuInt4Linear:  # the file's codes, scale and zero rounded to bfloat16 (2^-9 each)
                assert ((held - want).abs() <= 2.0**-7 * want.abs().amax(dim=(1, 2), keepdim=True)).all(), layer
            else:  # Q8_0's block scales as one per output channel: half the row's step
                steps = torch.stack([m.scales.float() for m in getattr(experts, f"{proj}_proj")])[..., None]
                assert ((held - want).abs() <= steps / 2 + 1e-6).all(), layer
    label = f"{variant} {qtype.name}/{down.name} experts{' per expert' if per_expert else ''}"
    got, got_routes, _ = _routed_logits(kept)
    want, want_routes, want_gaps = _routed_logits(ref)
    flipped = (got_routes != want_routes).any(-1)  # [positions, sparse layers]
    alike = ~flipped.any(-1)
    assert alike.float().mean() >= 0.9, f"{label}: {int((~alike).sum())} of {len(alike)} positions routed apart"
    assert (want_gaps[flipped] <= want_gaps.median() / 2).all(), (label, want_gaps[flipped].tolist())
    compare_logits(got[alike], want[alike], capsys, label, near_tie=1.0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert all(len(o.token_ids) == 12 for o in kept.generate(quant_prompts(), params))


def _stacked(expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``...mlp.experts.E.proj.weight`` tensors stacked per projection, as ``...mlp.experts.proj.weight``."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    for name, weight in expected.items():
        head, sep, rest = name.partition(".mlp.experts.")
        expert, _, proj = rest.partition(".")
        if sep and expert.isdigit():
            groups.setdefault(f"{head}.mlp.experts.{proj}", {})[int(expert)] = weight
    return {name: np.stack([w[e] for e in sorted(w)]) for name, w in groups.items()}


def _routed_logits(llm: LLM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced logits ``[P, V]`` of ``quant_prompts()``, each sparse layer's chosen experts ``[P, L, k]``
    (sorted), and its routing margin ``[P, L]``: the k-th chosen expert's probability over the first left out."""
    blocks = [layer.mlp for layer in llm.engine.loaded.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    routes: list[list[torch.Tensor]] = [[] for _ in blocks]
    gaps: list[list[torch.Tensor]] = [[] for _ in blocks]

    def recorder(i: int, k: int) -> Callable[..., None]:
        def record(module: torch.nn.Module, args: object, logits: torch.Tensor) -> None:
            probs = torch.softmax(logits.float(), dim=-1).topk(k + 1)
            routes[i].append(probs.indices[:, :k].sort(dim=-1).values)
            gaps[i].append(probs.values[:, k - 1] - probs.values[:, k])

        return record

    hooks = [block.gate.register_forward_hook(recorder(i, block.top_k)) for i, block in enumerate(blocks)]
    try:
        logits = torch.cat([engine_logits(llm, p) for p in quant_prompts()])
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack([torch.cat(r) for r in routes], 1), torch.stack([torch.cat(g) for g in gaps], 1)


@pytest.mark.parametrize("method", ["cpu-int4", "cpu-int8"])
def test_a_float_moe_checkpoint_quantizes_its_experts_at_load(
    method: str, model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("mixtral")
    llm = make_llm(path, quantization=method, num_kv_blocks=32)
    assert llm.engine.loaded.dtype == torch.bfloat16
    float_weights = load_file(str(path / "model.safetensors"))
    kind = {"cpu-int4": CpuInt4Linear, "cpu-int8": CpuInt8Linear}[method]
    for layer, experts in _experts(llm).items():
        assert isinstance(experts, CpuQuantizedExperts)
        gate_up, _ = experts.dequantized()
        assert all(isinstance(m, kind) for m in experts.gate_up_proj)
        for e in range(experts.num_experts):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            want = torch.cat([float_weights[f"{prefix}.{w}.weight"] for w in ("w1", "w3")]).float()
            # Either scheme rounds each weight by at most half a step of 1/15 (int4) or 1/254 (int8) of the
            # span it quantizes over, after the bfloat16 model's own rounding of the weight (2^-9).
            bound = want.abs().max() * ((2 / 15 if method == "cpu-int4" else 1 / 127) * 0.51 + 2.0**-8)
            assert (gate_up[e] - want).abs().max() <= bound, (layer, e)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7, 8]], params)[0].token_ids) == 6


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_an_int4_moe_checkpoint_is_refused_by_name(
    method: str, tmp_path: Path, model_dir: Callable[[str], Path]
) -> None:
    """AWQ / GPTQ pack each expert's projections apart, and the INT4 loader does not read them into the stacked
    experts: a Mixtral checkpoint declaring either is refused before any weight is read."""
    source = model_dir("mixtral")
    folder = tmp_path / method
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^AWQ / GPTQ quantization is not supported for MixtralForCausalLM: "):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)
