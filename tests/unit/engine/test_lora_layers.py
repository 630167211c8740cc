"""``LoRALinear`` adds exactly the slot adapters' deltas to whatever projection it wraps (float or quantized), costs
nothing without adapter tokens; decode batches with adapters take the decode graphs' LoRA variant."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from needs import require, require_triton_interpreter
from torch import nn

from gpu_workers.engine import LLM, LoRARequest, SamplingParams
from gpu_workers.engine.execution.cuda_graphs import DecodeGraphRunner, DecodeRows
from gpu_workers.engine.lora import LoRABatch
from gpu_workers.engine.lora.layers import LoRAContext, LoRALinear, LoRASlice
from gpu_workers.engine.quantization.cpu_linear import CpuInt8Linear

from .lora_adapters import MergedReference, make_adapter


def _base(kind: str) -> tuple[nn.Module, torch.dtype]:
    linear = nn.Linear(32, 24, bias=True)
    if kind == "cpu-int8":  # as the engine builds it: from a bfloat16 model (cpu-int8's dtype)
        return CpuInt8Linear.from_linear(linear.to(torch.bfloat16)), torch.bfloat16
    return linear, torch.float32


@pytest.mark.parametrize("kind", ["linear", "cpu-int8"])
def test_delta_over_any_projection(kind: str) -> None:
    torch.manual_seed(0)
    base, dtype = _base(kind)
    context = LoRAContext()
    # Two slices (like q and kv of qkv_proj): 16 + 8 output columns.
    slices = [LoRASlice("q_proj", 32, 16, 0), LoRASlice("k_proj", 32, 8, 16)]
    lora = LoRALinear(
        base, slices, max_loras=3, max_lora_rank=8, context=context, dtype=dtype, device=torch.device("cpu")
    )
    a_q, b_q = torch.randn(4, 32), torch.randn(16, 4)
    a_k, b_k = torch.randn(4, 32), torch.randn(8, 4)
    lora.set_slot(2, {"q_proj": (a_q, b_q), "k_proj": (a_k, b_k)}, scale=0.5)
    lora.set_slot(0, {"q_proj": (a_q * 2, b_q)}, scale=1.0)  # targets q only: k's columns get nothing
    x = torch.randn(5, 32, dtype=dtype)
    plain = base(x)
    assert torch.equal(lora(x), plain)  # no step context: the base alone
    with context.active(LoRABatch.from_runs([(2, 2), (-1, 1), (0, 2)], "cpu")):
        out = lora(x)
    xf = x.float()
    expected = plain.float().clone()
    expected[:2, :16] += 0.5 * (xf[:2] @ a_q.T) @ b_q.T
    expected[:2, 16:] += 0.5 * (xf[:2] @ a_k.T) @ b_k.T
    expected[3:, :16] += (xf[3:] @ (2 * a_q).T) @ b_q.T
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * 10)
    assert torch.equal(out[2], plain[2])  # the base-model token is untouched


def test_a_slice_no_resident_adapter_targets_is_skipped() -> None:
    base = nn.Linear(32, 24, bias=False)
    context = LoRAContext()
    slices = [LoRASlice("q_proj", 32, 16, 0), LoRASlice("v_proj", 32, 8, 16)]
    lora = LoRALinear(base, slices, max_loras=2, max_lora_rank=4, context=context, dtype=torch.float32,
                      device=torch.device("cpu"))  # fmt: skip
    lora.set_slot(0, {"q_proj": (torch.randn(4, 32), torch.randn(16, 4))}, scale=1.0)
    lora.set_slot(1, {"q_proj": (torch.randn(4, 32), torch.randn(16, 4))}, scale=1.0)
    assert lora.targeting == [{0, 1}, set()]
    # Garbage in v's slot-0 stack and scale: only v's empty targeting keeps it out of the output.
    lora.a[1][0].fill_(1.0)
    lora.b[1][0].fill_(1.0)
    lora.scales[1][0] = 1.0
    x = torch.randn(3, 32)
    with context.active(LoRABatch.from_runs([(0, 3)], "cpu")):
        out = lora(x)
    assert torch.equal(out[:, 16:], base(x)[:, 16:])
    lora.set_slot(1, {"v_proj": (torch.randn(4, 32), torch.randn(8, 4))}, scale=1.0)  # slot 1 now adapts v only
    assert lora.targeting == [{0}, {1}]


def _counting_graph_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(rows, with LoRA slots) of every decode step that takes the graph path."""
    runs: list[tuple[int, bool]] = []
    original = DecodeGraphRunner.run

    def counting_run(self: DecodeGraphRunner, rows: DecodeRows) -> torch.Tensor:
        runs.append((len(rows), rows.lora_slots is not None))
        return original(self, rows)

    monkeypatch.setattr(DecodeGraphRunner, "run", counting_run)
    return runs


def _graph_path_case(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = model_dir("llama")
    # One adapter on every projection, one on q and v only (PEFT's default): their slices differ.
    # The first is strong (std 0.3), so a leak of it into another row changes that row's greedy tokens.
    adapters = [make_adapter(base, tmp_path / "r8", 8, seed=29, std=0.3),
                make_adapter(base, tmp_path / "r4", 4, seed=25, targets=("q_proj", "v_proj"))]  # fmt: skip
    ref = MergedReference(base)
    runs = _counting_graph_runs(monkeypatch)
    # Two slots, both filled below: a base or padding row (slot -1) that were not masked would read one of them.
    llm = make_llm(base, enable_lora=True, max_loras=2)
    # The padded static-buffer path the CUDA graphs replay, run eagerly on the CPU.
    llm.engine.runner.enable_decode_graphs(max_num_seqs=8, max_model_len=llm.engine.max_model_len, capture=False)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 14, 6)]
    loras = [LoRARequest("r8", 1, str(adapters[0])), LoRARequest("r4", 2, str(adapters[1]))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)  # base only: decode steps go through the graph path without LoRA slots
    assert runs and not any(with_lora for _, with_lora in runs), runs
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.token_ids == ref.greedy(None, prompt, 6)
    runs.clear()
    # Two adapters targeting different modules and a base-model row in each decode batch (3 rows: bucket 4, so a
    # padding row too): the graph path with each row's slot read from the static buffer.
    # The q/v adapter is acquired first and takes slot 1, so the every-projection one sits in slot 0: the slot an
    # unmasked -1 would read.
    chosen = [loras[1], None, loras[0]]
    outs = llm.generate(prompts, params, lora_request=chosen)
    assert runs and all(with_lora for _, with_lora in runs), runs
    for out, prompt, lora in zip(outs, prompts, chosen, strict=True):
        path = None if lora is None else Path(lora.lora_path)
        assert out.token_ids == ref.greedy(path, prompt, 6)
    # The adapter in slot 0 changes the base row's continuation, so a leak into that row would show.
    assert ref.greedy(Path(loras[0].lora_path), prompts[1], 6) != ref.greedy(None, prompts[1], 6)


def _triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Route ``add_lora`` to the Triton kernels on CPU tensors (Triton's interpreter); returns the kernels module."""
    from gpu_workers.engine.lora import kernels as lora_kernels

    try:
        from gpu_workers.engine.lora import triton_lora
    except ImportError:
        require(False, "triton", "a dependency of torch; pip install -e '.[dev]'")
        raise
    require_triton_interpreter(triton_lora.INTERPRETED)
    monkeypatch.setattr(lora_kernels, "TRITON_ON_CPU", True)
    return lora_kernels


def test_decode_graph_path_carries_adapter_slots(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode batches with adapters take the graph path (a LoRA variant per bucket), with the torch strategies."""
    _graph_path_case(model_dir, tmp_path, make_llm, monkeypatch)


def test_decode_graph_path_through_the_triton_kernels(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the per-row Triton launches a GPU's graphs capture, run by Triton's interpreter."""
    _triton_on_cpu(monkeypatch)
    _graph_path_case(model_dir, tmp_path, make_llm, monkeypatch)


def test_engine_through_the_triton_kernels(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a GPU takes (the Triton shrink/expand kernels), run by Triton's interpreter on the CPU."""
    lora_kernels = _triton_on_cpu(monkeypatch)
    calls: list[int] = []
    launcher = lora_kernels._triton_add_lora()
    assert launcher is not None

    def counting(*args: object) -> None:
        calls.append(1)
        launcher(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(lora_kernels, "_TRITON_ADD", counting)
    base = model_dir("llama")
    adapters = [make_adapter(base, tmp_path / f"r{r}", r, seed=30 + r) for r in (4, 16)]
    ref = MergedReference(base)
    llm = make_llm(base, enable_lora=True)
    prompts = [[5, 9, 200, 31, 77], [400, 401, 3, 3, 8, 12, 19, 140, 141, 142, 143, 144, 145, 146, 147, 148, 149]]
    loras = [LoRARequest("r4", 1, str(adapters[0])), LoRARequest("r16", 2, str(adapters[1])), None]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompts[0], prompts[1], prompts[1]], params, lora_request=loras)
    assert calls, "the Triton kernels did not run"
    for out, prompt, path in zip(outs, [prompts[0], prompts[1], prompts[1]], [*adapters, None], strict=True):
        assert out.token_ids == ref.greedy(path, prompt, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_lora_graphs_give_the_eager_tokens(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """On a GPU: decode steps with adapters replay the captured LoRA graphs (captured before any adapter was loaded,
    so with every slice) and give exactly the tokens of eager execution, with the adapters' slots changing between
    steps and a base-model row beside them."""
    base = model_dir("llama")
    adapters = [make_adapter(base, tmp_path / "r8", 8, seed=29, std=0.3),
                make_adapter(base, tmp_path / "r4", 4, seed=25, targets=("q_proj", "v_proj"))]  # fmt: skip
    loras = [LoRARequest("r8", 1, str(adapters[0])), LoRARequest("r4", 2, str(adapters[1]))]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 40))] for _ in range(7)]
    chosen = [loras[i % 2] if i % 3 else None for i in range(len(prompts))]
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    results = {}
    for eager in (True, False):
        # fp32, as the base graphs' test: only rounding far below a logit gap keeps greedy tokens identical.
        llm = make_llm(base, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                       enable_lora=True, max_loras=2)  # fmt: skip
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        results[eager] = [o.token_ids for o in llm.generate(prompts, params, lora_request=chosen)]
        graphs = llm.engine.runner.decode_graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.num_replays > 0
    assert results[False] == results[True]
