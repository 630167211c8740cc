"""``LoRALinear`` adds exactly the slot adapters' deltas to whatever projection it wraps (float or quantized), costs
nothing without adapter tokens; decode batches with adapters bypass the decode graphs (captured without them)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from gpu_workers.engine import LLM, LoRARequest, SamplingParams
from gpu_workers.engine.execution.cuda_graphs import DecodeGraphRunner
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


def test_decode_graph_path_skips_adapter_batches(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = model_dir("llama")
    adapter = make_adapter(base, tmp_path / "r8", 8, seed=21)
    ref = MergedReference(base)
    runs: list[int] = []
    original = DecodeGraphRunner.run

    def counting_run(self: DecodeGraphRunner, rows: object) -> torch.Tensor:
        runs.append(len(rows))  # type: ignore[arg-type]
        return original(self, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphRunner, "run", counting_run)
    llm = make_llm(base, enable_lora=True)
    # The padded static-buffer path the CUDA graphs replay, run eagerly on the CPU.
    llm.engine.runner.enable_decode_graphs(max_num_seqs=8, max_model_len=llm.engine.max_model_len, capture=False)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 14, 6)]
    lora = LoRARequest("r8", 1, str(adapter))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)  # base only: decode steps go through the graph path
    assert runs, "base-model decode batches did not use the graph path"
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.token_ids == ref.greedy(None, prompt, 6)
    runs.clear()
    outs = llm.generate(prompts, params, lora_request=[lora, None, lora])  # every decode batch uses the adapter
    assert not runs, "a decode batch with adapter tokens replayed the graph captured without adapters"
    for out, prompt, path in zip(outs, prompts, (adapter, None, adapter), strict=True):
        assert out.token_ids == ref.greedy(path, prompt, 6)


def test_engine_through_the_triton_kernels(
    model_dir: Callable[[str], Path], tmp_path: Path, make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a GPU takes (the Triton shrink/expand kernels), run by Triton's interpreter on the CPU."""
    from gpu_workers.engine.lora import kernels as lora_kernels

    try:
        from gpu_workers.engine.lora import triton_lora
    except ImportError:
        pytest.skip("triton is not installed")
    if not triton_lora.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 before triton's first import")
    monkeypatch.setattr(lora_kernels, "TRITON_ON_CPU", True)
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
