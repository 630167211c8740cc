"""The batched multi-LoRA delta (``gpu_workers.engine.lora.add_lora``) against a naive per-token loop: both torch
strategies (gathered per-token weights, per-segment matmuls) and the Triton kernels (compiled on CUDA, through
Triton's interpreter on CPU; tests/conftest.py sets TRITON_INTERPRET=1 before triton's first import), for
base-only, single- and multi-adapter batches, zero-padded ranks, merged-projection slices, fp32 and bf16."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from needs import require, require_triton_interpreter

from gpu_workers.engine.lora import LoRABatch, add_lora
from gpu_workers.engine.lora import kernels as lora_kernels

HAS_CUDA = torch.cuda.is_available()
DTYPES = (torch.float32, torch.bfloat16)

# (name, runs): (slot, tokens) per sequence in step order, -1 = base model.
MIXES = {
    "base_only": [(-1, 3), (-1, 1)],
    "one_adapter_decode": [(2, 1)],
    "decode_mix": [(0, 1), (-1, 1), (3, 1), (1, 1), (3, 1), (-1, 1), (2, 1)],
    "prefill_segments": [(-1, 5), (1, 37), (1, 4), (2, 1), (-1, 2), (0, 19)],
    "long_single": [(2, 70)],
}


def _stacks(
    slots: int, rank: int, in_f: int, out: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Slot-stacked A/B with a different effective rank per slot (zero-padded to ``rank``) and a per-slot scale."""
    gen = torch.Generator().manual_seed(seed)
    ranks = [rank, max(1, rank // 4), rank // 2 + 1, 0][:slots] + [rank] * max(0, slots - 4)
    a = torch.zeros(slots, rank, in_f)
    b = torch.zeros(slots, out, rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=gen) / in_f**0.5
        b[s, :, :r] = torch.randn(out, r, generator=gen)
    scales = torch.tensor([16.0 / max(r, 1) for r in ranks], dtype=torch.float32)
    scales[ranks.index(0)] = 0.0  # the empty slot's scale, as the slot manager leaves it
    return a.to(device, dtype), b.to(device, dtype), scales.to(device), ranks


def _reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               token_slots: list[int], out_offset: int) -> torch.Tensor:  # fmt: skip
    """fp32, one token at a time: the definition of the delta."""
    ref = y.float().clone()
    out = b.shape[1]
    for t, s in enumerate(token_slots):
        if s >= 0:
            h = x[t].float() @ a[s].float().T
            ref[t, out_offset : out_offset + out] += scales[s].float() * (h @ b[s].float().T)
    return ref


def _assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        # bf16: y's own rounding plus h's rounding to x's dtype, a few ulps of the largest values.
        torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


def _assert_matches_beside_poison(y: torch.Tensor, y0: torch.Tensor, ref: torch.Tensor, token_slots: list[int]) -> None:
    """fp32 ``y`` against ``ref`` when a slot's scale is a ~1e3 poison: base rows (-1) must come back bitwise
    untouched, and the other rows close within a bound that scales with the delta's size. A row on the poison slot
    adds terms ~1e3 times the others that largely cancel, so sums taken in another order differ by a few ulps of the
    terms, not of the result (a fixed 1e-4 failed about one seed in 60)."""
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(y[base], y0[base])
    delta = (ref - y0.float()).abs().max().item()
    torch.testing.assert_close(y, ref, atol=max(1e-4, 1e-6 * delta), rtol=1e-4)


def _run_case(
    mix: str, dtype: torch.dtype, device: str, strategy: str, *, seed: int = 0, y_dtype: torch.dtype | None = None
) -> None:
    runs = MIXES[mix]
    batch = LoRABatch.from_runs(runs, device)
    if strategy in ("gather", "segments"):
        batch = dataclasses.replace(batch, use_segments=strategy == "segments")
    tokens = batch.num_tokens
    in_f, slices = 80, (70, 24, 24)  # a merged projection: three slices, each its own stacks
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, in_f, generator=gen).to(device, dtype)
    y = torch.randn(tokens, sum(slices), generator=gen).to(device, y_dtype or dtype)
    ref = y.float().clone()
    token_slots = batch.token_slots.tolist()
    offset = 0
    for i, out in enumerate(slices):
        a, b, scales, _ = _stacks(4, 16, in_f, out, dtype, device, seed + 10 * i)
        ref = _reference(ref, x, a, b, scales, token_slots, offset)
        add_lora(y, x, a, b, scales, batch, out_offset=offset)
        offset += out
    _assert_matches(y, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("strategy", ["gather", "segments", "auto"])
def test_torch_path_matches_per_token_reference(mix: str, dtype: torch.dtype, strategy: str) -> None:
    _run_case(mix, dtype, "cpu", strategy)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("strategy", ["gather", "segments"])
def test_float32_adapters_onto_a_bfloat16_output(mix: str, strategy: str) -> None:
    """How a bf16 model runs its adapters on a CPU: x and the stacks in fp32, the delta rounded once onto y."""
    _run_case(mix, torch.float32, "cpu", strategy, y_dtype=torch.bfloat16)


def test_base_only_batch_leaves_y_untouched() -> None:
    batch = LoRABatch.from_runs(MIXES["base_only"], "cpu")
    assert not batch.has_lora
    a, b, scales, _ = _stacks(4, 8, 16, 12, torch.float32, "cpu", 0)
    x, y = torch.randn(4, 16), torch.randn(4, 12)
    before = y.clone()
    add_lora(y, x, a, b, scales, batch)
    assert torch.equal(y, before)


def test_zero_padded_rank_equals_the_unpadded_adapter() -> None:
    """A rank-4 adapter padded to R=16 gives exactly what its rank-4 matrices give."""
    a, b, scales, ranks = _stacks(4, 16, 32, 20, torch.float32, "cpu", 3)
    batch = LoRABatch.from_runs([(1, 3)], "cpu")
    x = torch.randn(3, 32)
    y = torch.zeros(3, 20)
    add_lora(y, x, a, b, scales, batch)
    r = ranks[1]
    expected = scales[1] * (x @ a[1, :r].T) @ b[1, :, :r].T
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_strategy_threshold_picks_gather_for_decode_and_segments_for_prefill() -> None:
    decode = LoRABatch.from_runs([(i % 4, 1) for i in range(16)], "cpu")
    prefill = LoRABatch.from_runs([(0, 64), (1, 64)], "cpu")
    assert not decode.use_segments
    assert prefill.use_segments


def test_from_runs_metadata() -> None:
    batch = LoRABatch.from_runs([(-1, 2), (1, 3), (1, 2), (0, 1), (-1, 1), (1, 1)], "cpu")
    assert batch.num_tokens == 10
    assert batch.token_slots.tolist() == [-1, -1, 1, 1, 1, 1, 1, 0, -1, 1]
    # Consecutive runs of one slot merge; base runs are no segment.
    assert batch.seg_starts_list == (2, 7, 9)
    assert batch.seg_lens_list == (5, 1, 1)
    assert batch.seg_slots_list == (1, 0, 1)
    assert batch.seg_starts.tolist() == [2, 7, 9] and batch.seg_starts.dtype == torch.int32
    assert batch.lora_tokens.tolist() == [2, 3, 4, 5, 6, 7, 9]
    assert batch.lora_slots.tolist() == [1, 1, 1, 1, 1, 0, 1]
    assert batch.max_seg_len == 5 and batch.max_slot == 1 and batch.has_lora


def test_from_runs_empty_step() -> None:
    batch = LoRABatch.from_runs([], "cpu")
    assert batch.num_tokens == 0 and not batch.has_lora and batch.token_slots.shape == (0,)
    add_lora(torch.zeros(0, 4), torch.zeros(0, 3), torch.zeros(1, 2, 3), torch.zeros(1, 4, 2), torch.ones(1), batch)


@pytest.mark.parametrize("runs", [[(0, 2), (1, 0)], [(0, -1)], [(-2, 1)]])
def test_from_runs_rejects_bad_runs(runs: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match="LoRA"):
        LoRABatch.from_runs(runs, "cpu")


def test_add_lora_rejects_slot_outside_the_stacks_and_bad_shapes() -> None:
    a, b, scales, _ = _stacks(4, 8, 16, 12, torch.float32, "cpu", 0)
    x, y = torch.randn(2, 16), torch.zeros(2, 12)
    with pytest.raises(ValueError, match="slot 4"):
        add_lora(y, x, a, b, scales, LoRABatch.from_runs([(4, 2)], "cpu"))
    batch = LoRABatch.from_runs([(1, 2)], "cpu")
    with pytest.raises(ValueError, match="rows"):
        add_lora(y, torch.randn(3, 16), a, b, scales, batch)
    with pytest.raises(ValueError, match="out_offset"):
        add_lora(y, x, a, b, scales, batch, out_offset=1)
    with pytest.raises(ValueError, match="inconsistent"):
        add_lora(y, x, a, b[:, :, :4], scales, batch)
    assert torch.equal(y, torch.zeros(2, 12))  # nothing was written by the rejected calls


def _triton_ready(monkeypatch: pytest.MonkeyPatch) -> str:
    """The device the Triton kernels run on here; on CPU, only through the interpreter."""
    try:
        triton_lora = importlib.import_module("gpu_workers.engine.lora.triton_lora")
    except ImportError:
        require(False, "triton", "a dependency of torch; pip install -e '.[dev]'")
        raise
    if HAS_CUDA:
        return "cuda"
    require_triton_interpreter(triton_lora.INTERPRETED)
    monkeypatch.setattr(lora_kernels, "TRITON_ON_CPU", True)
    return "cpu"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", ["decode_mix", "prefill_segments", "long_single", "one_adapter_decode"])
def test_triton_path_matches_per_token_reference(mix: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    device = _triton_ready(monkeypatch)
    calls: list[int] = []
    launcher = lora_kernels._triton_add_lora()
    assert launcher is not None

    def counting(*args: object) -> None:
        calls.append(1)
        launcher(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(lora_kernels, "_triton_add_lora", lambda: counting)
    _run_case(mix, dtype, device, "auto", seed=7)
    assert len(calls) == 3  # one launch per slice: the Triton path ran, not the torch fallback


def test_triton_kernels_mask_base_and_padding_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-token metadata with base tokens (slot -1) and an empty padding segment, the fixed-grid form a CUDA
    graph would replay: base rows and the padding stay untouched."""
    device = _triton_ready(monkeypatch)
    batch = LoRABatch.from_runs(MIXES["decode_mix"], device)
    token_slots = batch.token_slots.tolist()
    tokens = batch.num_tokens
    starts, lens, slots = [*range(tokens), 0], [1] * tokens + [0], [*token_slots, 1]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    per_token = dataclasses.replace(
        batch,
        seg_starts=ints(starts),
        seg_lens=ints(lens),
        seg_slots=ints(slots),
        seg_starts_list=tuple(starts),
        seg_lens_list=tuple(lens),
        seg_slots_list=tuple(slots),
        max_seg_len=1,
    )
    a, b, scales, _ = _stacks(5, 16, 40, 30, torch.float32, device, 5)
    # The stacks are views one slot into their storage: an unmasked slot -1 would read that poison slot.
    scales[0] = 1e3
    a, b, scales = a[1:], b[1:], scales[1:]
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, 40, generator=gen).to(device)
    y = torch.randn(tokens, 30, generator=gen).to(device)
    y0 = y.clone()
    ref = _reference(y, x, a, b, scales, token_slots, 0)
    add_lora(y, x, a, b, scales, per_token)
    _assert_matches_beside_poison(y, y0, ref, token_slots)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_per_row_batch_reads_slots_when_it_runs(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LoRABatch.per_row`` (a decode graph's batch): the slots are read from the device buffer at each call, so a
    buffer rewritten after the batch was built takes effect; base and padding rows (-1) stay untouched on both paths,
    even with a poison slot 0 an unmasked -1 would read."""
    device = _triton_ready(monkeypatch) if path == "triton" else "cpu"
    rows = 6
    slots = torch.full((rows,), 3, dtype=torch.int32, device=device)  # stale: overwritten below
    batch = LoRABatch.per_row(
        slots, torch.arange(rows, dtype=torch.int32, device=device), torch.ones(rows, dtype=torch.int32, device=device)
    )
    assert batch.has_lora and batch.num_segments == rows and batch.max_seg_len == 1 and batch.slots_on_device
    a, b, scales, _ = _stacks(4, 16, 40, 30, torch.float32, device, 9)
    scales[0] = 1e3  # the poison slot
    token_slots = [2, -1, 0, 3, -1, -1]
    slots.copy_(torch.tensor(token_slots, dtype=torch.int32))
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(rows, 40, generator=gen).to(device)
    y = torch.randn(rows, 30, generator=gen).to(device)
    y0 = y.clone()
    ref = _reference(y, x, a, b, scales, token_slots, 0)
    add_lora(y, x, a, b, scales, batch)
    _assert_matches_beside_poison(y, y0, ref, token_slots)
    with pytest.raises(ValueError, match="per-row LoRA batch"):
        LoRABatch.per_row(slots, slots[:2], slots)
