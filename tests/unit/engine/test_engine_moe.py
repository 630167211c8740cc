"""The mixture-of-experts block: routing and experts against transformers' own modules, the Triton grouped GEMM
against the torch path (Triton's interpreter on the CPU), every checkpoint layout of the experts loading to the same
model, every expert routed by the parity suite's prompts, and the features MoE models refuse by name."""

from __future__ import annotations

# ruff: noqa: E402 - the imports below follow require_import (tests/needs.py), a CI-aware importorskip
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from needs import require_import, require_triton_interpreter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

require_import("triton", "a dependency of torch; pip install -e '.[dev]'")

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.moe import SparseMoeBlock, experts_torch, route
from gpu_workers.engine.models.moe_triton import INTERPRETED, align_by_expert, experts_triton

from .conftest import MODEL_VARIANTS, HFReference, random_prompts, shared_prefix_prompts

MOE_VARIANTS = ["mixtral", "qwen3_moe"]
HAS_CUDA = torch.cuda.is_available()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _random_experts(seed: int, experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    return gate_up, down


@pytest.mark.parametrize("norm", [True, False])
def test_routing_matches_transformers_routers(norm: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 32)
    config = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    qwen = Qwen3MoeTopKRouter(config)
    mixtral = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3))
    for router, renormalize in ((qwen, norm), (mixtral, True)):
        torch.nn.init.normal_(router.weight)
        logits, want_weights, want_ids = router(x)
        weights, ids = route(logits, 3, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights.float(), rtol=0, atol=0)
    # Without renormalization the chosen weights are plain softmax probabilities (sum < 1).
    weights, _ = route(torch.randn(20, 8), 3, renormalize=False)
    assert bool((weights.sum(-1) < 1).all())


def test_grouped_torch_experts_match_transformers_per_expert_loop() -> None:
    config = MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2)
    experts = MixtralExperts(config)
    gate_up, down = _random_experts(1, 6, 48, 40)
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    x = torch.randn(33, 48)
    weights, ids = route(torch.randn(33, 6), 2, True)
    assert torch.equal(experts_torch(x, gate_up, down, weights, ids), experts(x, ids, weights))


def test_align_by_expert_puts_each_slot_once_in_its_experts_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 0]])
    slots, block_expert = align_by_expert(ids, num_experts=5, block_m=4)
    num_slots = ids.numel()
    # Experts 0, 1, 2, 3 get 3, 2, 1, 4 slots: one 4-row block each; expert 4 none; the spare blocks are past the end.
    assert block_expert.tolist()[:4] == [0, 1, 2, 3]
    assert all(e == 5 for e in block_expert.tolist()[4:])
    real = slots[slots < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))
    for block, expert in enumerate(block_expert.tolist()[:4]):
        for slot in slots[block * 4 : (block + 1) * 4].tolist():
            assert slot == num_slots or ids.reshape(-1)[slot] == expert


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "dtype"),
    [
        (1, 8, 2, 64, 96, torch.float32),  # one decode token
        (37, 8, 2, 64, 96, torch.float32),
        (64, 4, 1, 48, 40, torch.float32),  # sizes off the tiles, top-1
        (19, 16, 4, 32, 80, torch.float32),  # more experts than hit ones
        (24, 8, 2, 64, 64, torch.bfloat16),
    ],
)
def test_triton_grouped_gemm_matches_the_torch_path(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    if not HAS_CUDA:
        require_triton_interpreter(INTERPRETED)
    device = "cuda" if HAS_CUDA else "cpu"
    gate_up, down = (w.to(device, dtype) for w in _random_experts(tokens, experts, hidden, inter))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    weights, ids = route(torch.randn(tokens, experts).to(device), top_k, renormalize=top_k > 1)
    want = experts_torch(x, gate_up, down, weights, ids)
    got = experts_triton(x, gate_up, down, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_block_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        SparseMoeBlock(16, 32, 4, 2, True, act="gelu")
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and the 4 experts"):
        SparseMoeBlock(16, 32, 4, 5, True, act="silu")


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_parity_prompts_route_to_every_expert(
    variant: str, model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    """The vs-transformers suite's prompts reach every expert of every sparse layer, so it checks them all."""
    llm = make_llm(model_dir(variant))
    model = llm.engine.loaded.model
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks, "no sparse layer"
    routed: list[set[int]] = [set() for _ in blocks]

    def recorder(seen: set[int], top_k: int) -> Callable[..., None]:
        return lambda module, args, logits: seen.update(logits.topk(top_k, dim=-1).indices.flatten().tolist())

    for block, seen in zip(blocks, routed, strict=True):
        block.gate.register_forward_hook(recorder(seen, block.top_k))
    variant_index = list(MODEL_VARIANTS).index(variant)
    prompts = random_prompts(seed=variant_index)[:4] + shared_prefix_prompts(seed=100 + variant_index)[:2]
    llm.generate([p for p, _ in prompts], [_greedy(min(n, 8)) for _, n in prompts])
    for layer, seen in enumerate(routed):
        assert seen == set(range(blocks[layer].num_experts)), f"sparse layer {layer} never routed to some expert"
    if variant == "qwen3_moe":
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [True, False, True]


def _restack(folder: Path, out: Path, fused: bool) -> Path:
    """A copy of ``folder`` with its per-expert tensors stacked: per projection ``[E, I, H]`` (as from a GGUF), or
    fused into transformers' in-memory ``gate_up_proj`` ``[E, 2I, H]`` (Mixtral's router renamed too)."""
    out.mkdir()
    for file in folder.iterdir():
        if file.name != "model.safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    num_experts = config.get("num_local_experts") or config["num_experts"]
    stacked: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        for moe, names in (("block_sparse_moe", ("w1", "w3", "w2")), ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            prefix = name.removesuffix(f".{moe}.experts.0.{names[0]}.weight")
            if prefix == name:
                continue
            parts = [
                torch.stack([tensors.pop(f"{prefix}.{moe}.experts.{e}.{n}.weight") for e in range(num_experts)])
                for n in names
            ]
            if moe == "block_sparse_moe":
                stacked[f"{prefix}.mlp.gate.weight"] = tensors.pop(f"{prefix}.block_sparse_moe.gate.weight")
            if fused:
                stacked[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat(parts[:2], dim=1)
                stacked[f"{prefix}.mlp.experts.down_proj"] = parts[2]
            else:
                for proj, part in zip(("gate_proj", "up_proj", "down_proj"), parts, strict=True):
                    stacked[f"{prefix}.mlp.experts.{proj}.weight"] = part
    assert stacked, "no expert tensors found"
    save_file(tensors | stacked, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_every_expert_layout_loads_the_same_model(
    variant: str, tmp_path: Path, model_dir: Callable[[str], Path], hf_reference: HFReference,
    make_llm: Callable[..., LLM],
) -> None:  # fmt: skip
    per_expert = model_dir(variant)
    # transformers' own save of the fused layout, and the per-projection stacks a GGUF converts to.
    model = AutoModelForCausalLM.from_pretrained(str(per_expert), dtype=torch.float32)
    model.save_pretrained(tmp_path / "fused_by_transformers", save_original_format=False)
    fused_names = load_file(str(tmp_path / "fused_by_transformers" / "model.safetensors")).keys()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in fused_names)
    folders = [
        tmp_path / "fused_by_transformers",
        _restack(per_expert, tmp_path / "stacked", fused=False),
        _restack(per_expert, tmp_path / "fused", fused=True),
    ]
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folders[0] / file).write_bytes((per_expert / file).read_bytes())
    prompts = random_prompts(seed=7)[2:5]
    for folder in folders:
        outputs = make_llm(folder).generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])
        for out, (prompt, n) in zip(outputs, prompts, strict=True):
            assert out.token_ids == hf_reference.greedy(per_expert, prompt, n), folder.name


def test_a_missing_or_extra_expert_is_a_load_error(tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    source = model_dir("mixtral")
    tensors = load_file(str(source / "model.safetensors"))
    folder = tmp_path / "missing"
    folder.mkdir()
    (folder / "config.json").write_bytes((source / "config.json").read_bytes())
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.1.mlp.experts.gate_up_proj\[11\]'\]"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)
    tensors["model.layers.1.block_sparse_moe.experts.8.w3.weight"] = torch.zeros(1)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="names expert 8 of a 8-expert layer"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        (dict(enable_lora=True), "LoRA"),
        (dict(tensor_parallel_size=2), "Tensor parallelism"),
        (dict(quantization="fp8"), "FP8 weight quantization"),
        (dict(quantization="bnb-nf4"), "bitsandbytes quantization"),
    ],
)
def test_moe_refuses_features_by_name(kwargs: dict[str, object], what: str, model_dir: Callable[[str], Path]) -> None:
    for variant, arch in (("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")):
        with pytest.raises(ValueError, match=f"^{what} is not supported for {arch}: "):
            LLM(str(model_dir(variant)), max_model_len=64, num_kv_blocks=8, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_engine_on_cuda_runs_the_triton_experts(
    model_dir: Callable[[str], Path], hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("mixtral")
    prompts = random_prompts(seed=11)[:6]
    llm = make_llm(path, device="cuda", dtype="float32")
    outputs = llm.generate([p for p, _ in prompts], [_greedy(n) for _, n in prompts])
    for out, (prompt, n) in zip(outputs, prompts, strict=True):
        assert out.token_ids == hf_reference.greedy(path, prompt, n)
