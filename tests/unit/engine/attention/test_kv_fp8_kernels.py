"""The FP8 (e4m3) KV cache in the Triton kernels and the torch backend: the store kernel quantizes
bit for bit as ``kv_quant.quantize_rows`` does, and attention over an FP8 cache equals dense float64
attention over the dequantized K/V (mixed batches, split-KV decode, cascade), so any mistake in a
scale, a cast or the folding of the scales into scores and outputs shows at fp32 tolerances.

Batches come from ``test_triton_kernels.make_batch`` (NaN in every slot no sequence owns); on a CPU
the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first).
"""

from __future__ import annotations

# ruff: noqa: E402 - the imports below follow require_import (tests/needs.py), a CI-aware importorskip
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from needs import require_import

require_import("triton", "a dependency of torch; pip install -e '.[dev]'")

from test_triton_kernels import DEVICES, MIXED_SEQS, TOLERANCE, Batch, dense_attention, make_batch

from gpu_workers.engine.attention import triton_kernels as tk
from gpu_workers.engine.attention.kv_quant import (
    CALIBRATION_HEADROOM,
    FP8_AS_FP16_FACTOR,
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    calibrate_scales,
    dequantize_rows,
    fp8_codes_as,
    quantize_rows,
)
from gpu_workers.engine.attention.torch_backend import TorchAttentionBackend, write_kv


def _fp8_batch(batch: Batch) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """The same batch over an FP8 cache: scales from the whole dense K/V (per KV head), cached
    context quantized with them (unowned NaN slots stay NaN), and the dense ground truth replaced
    by its quantize -> dequantize round trip, which is exactly what the kernels can see."""
    all_k, all_v = torch.cat(batch.keys).float(), torch.cat(batch.values).float()
    k_scale, v_scale = torch.empty(all_k.shape[1]), torch.empty(all_k.shape[1])
    calibrate_scales(all_k, all_v, k_scale, v_scale)

    def cache(c: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        flat = c.detach().cpu().float().view(-1, *c.shape[2:])
        return quantize_rows(flat, scale).view(c.shape).to(c.device)

    def round_trip(rows: list[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
        return [dequantize_rows(quantize_rows(r, scale), scale, torch.float32).to(r.dtype) for r in rows]

    device = batch.q.device
    fp8 = replace(
        batch,
        k_cache=cache(batch.k_cache, k_scale),
        v_cache=cache(batch.v_cache, v_scale),
        keys=round_trip(batch.keys, k_scale),
        values=round_trip(batch.values, v_scale),
    )
    return fp8, k_scale.to(device), v_scale.to(device)


def _assert_matches(out: torch.Tensor, batch: Batch, scale: float, dtype: torch.dtype) -> None:
    expected = dense_attention(batch, scale)
    got = out[: batch.num_real_tokens].detach().cpu().double()
    assert torch.isfinite(got).all()
    err = (got - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} > {TOLERANCE[dtype]:.1g}"


@pytest.mark.parametrize("device", DEVICES)
def test_store_quantizes_bit_for_bit_like_torch(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, dim, tokens = 6, 16, 3, 80, 64
    scale = torch.tensor([0.5, 0.02, 3.0])  # head 0's power of two keeps the special values exact
    rows = torch.randn(tokens, heads, dim, generator=gen) * scale[:, None] * 200
    # Values that round across an exponent (7.96 -> 8 after scaling), exact ties, saturation past
    # 448, e4m3 subnormals (below 2^-6) and zeros, on the first head's scale.
    special = torch.tensor([7.96, 7.9999, 15.9, 9.0, 9.25, 500.0, -1e6, 0.011, 0.0009, 2.0**-10, 0.0, -0.0])
    rows[1, 0, : special.numel()] = special * scale[0]
    v_rows = rows.flip(0) * 0.7
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    k_ref = torch.zeros(num_blocks, block_size, heads, dim, dtype=FP8_KV_DTYPE)
    v_ref = torch.zeros_like(k_ref)
    write_kv(rows, v_rows, k_ref, v_ref, slots, scale, scale)

    k_cache, v_cache = torch.zeros_like(k_ref).to(device), torch.zeros_like(v_ref).to(device)
    sd = scale.to(device)
    tk.store_kvcache(rows.to(device), v_rows.to(device), k_cache, v_cache, slots.to(device), sd, sd)
    assert torch.equal(k_cache.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), v_ref.view(torch.uint8))
    # And the torch twin is the plain saturating e4m3 cast (round to nearest even).
    stored = k_ref.view(-1, heads, dim)[slots[1]][0, : special.numel()].float()
    expected = special.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE).float()
    assert torch.equal(stored, expected), (stored, expected)
    assert stored[0] == 8.0 and stored[5] == FP8_KV_MAX and stored[6] == -FP8_KV_MAX


@pytest.mark.parametrize("device", DEVICES)
def test_store_encodes_every_rounding_boundary_like_torch(device: str) -> None:
    """Every finite e4m3 value, each midpoint between neighbours (a tie) and the fp32 values just
    either side of it, both signs, scale 1: the kernel's bytes equal torch's saturating cast."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_KV_DTYPE).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    probes = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    probes = torch.cat([probes, -probes, torch.tensor([448.5, 460.0, -1e9, 2.0**-12])])
    dim = 16
    rows = torch.nn.functional.pad(probes, (0, -probes.numel() % dim)).view(-1, 1, dim)
    slots = torch.arange(rows.shape[0])
    k_ref = torch.zeros(rows.shape[0], 1, 1, dim, dtype=FP8_KV_DTYPE)
    v_ref = torch.zeros_like(k_ref)
    one = torch.ones(1)
    write_kv(rows, rows, k_ref, v_ref, slots, one, one)
    k_cache, v_cache = torch.zeros_like(k_ref).to(device), torch.zeros_like(v_ref).to(device)
    d = one.to(device)
    tk.store_kvcache(rows.to(device), rows.to(device), k_cache, v_cache, slots.to(device), d, d)
    got, want = k_cache.cpu().view(torch.uint8).flatten(), k_ref.view(torch.uint8).flatten()
    wrong = (got != want).nonzero().flatten()[:8]
    detail = [(rows.flatten()[i].item(), int(got[i]), int(want[i])) for i in wrong]
    assert wrong.numel() == 0, f"(value, kernel byte, torch byte): {detail}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype", "num_splits"),
    [
        pytest.param(16, 4, 4, 64, torch.float32, 1, id="bs16-mha-fp32"),
        pytest.param(32, 8, 2, 128, torch.float32, 3, id="bs32-gqa4-fp32-split3"),
        pytest.param(24, 6, 2, 80, torch.bfloat16, 1, id="bs24-gqa3-d80-bf16"),
    ],
)
def test_fp8_cache_attention_matches_dequantized_reference(
    device: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_splits: int
) -> None:
    batch = make_batch(
        MIXED_SEQS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device, num_pad_tokens=2, seed=head_dim,
    )  # fmt: skip
    fp8, k_scale, v_scale = _fp8_batch(batch)
    scale = head_dim**-0.5
    tk.store_kvcache(fp8.k_new, fp8.v_new, fp8.k_cache, fp8.v_cache, fp8.meta.slot_mapping, k_scale, v_scale)
    out = tk.paged_attention(
        fp8.q, fp8.k_cache, fp8.v_cache, fp8.meta, scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale
    )
    assert out.dtype == dtype
    _assert_matches(out, fp8, scale, dtype)
    # Against the unquantized K/V the FP8 cache stays close (e4m3 keeps 3 mantissa bits).
    exact = dense_attention(batch, scale)
    cosine = F.cosine_similarity(out[: batch.num_real_tokens].cpu().double().flatten(), exact.flatten(), dim=0)
    assert cosine.item() >= 0.995


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cascade_matches_dequantized_reference(device: str) -> None:
    # Four decodes and a prefill chunk on a 3-block shared prefix, prefix pass split in two.
    seqs = [(70, 1), (90, 1), (51, 1), (64, 1), (80, 12)]
    batch = make_batch(
        seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=device, shared_prefix_blocks=3, seed=3,
    )  # fmt: skip
    fp8, k_scale, v_scale = _fp8_batch(batch)
    tk.store_kvcache(fp8.k_new, fp8.v_new, fp8.k_cache, fp8.v_cache, fp8.meta.slot_mapping, k_scale, v_scale)
    out = tk.cascade_paged_attention(
        fp8.q, fp8.k_cache, fp8.v_cache, fp8.meta, 0.125, 48, num_splits=2, prefix_splits=2,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _assert_matches(out, fp8, 0.125, torch.float32)


def test_torch_backend_reads_fp8_cache_like_the_reference() -> None:
    # Every sequence has cached context (a whole fresh prompt attends its unquantized K/V instead).
    seqs = [(300, 1), (90, 20), (150, 70), (5, 1)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device="cpu")
    fp8, k_scale, v_scale = _fp8_batch(batch)
    out = TorchAttentionBackend().forward(
        fp8.q, fp8.k_new, fp8.v_new, fp8.k_cache, fp8.v_cache, fp8.meta, 0.125, k_scale=k_scale, v_scale=v_scale
    )
    _assert_matches(out, fp8, 0.125, torch.float32)


def test_fp8_codes_widen_exactly() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8_KV_DTYPE)  # every code but the two NaNs
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        widened = fp8_codes_as(codes, dtype).float() * FP8_AS_FP16_FACTOR
        assert torch.equal(widened, codes.float()), dtype


def test_calibration_leaves_headroom_per_head() -> None:
    k = torch.zeros(5, 2, 4)
    k[3, 0, 1], k[1, 1, 2] = -9.0, 0.5
    v = torch.zeros(5, 2, 4)  # an all-zero head must not give a zero scale
    k_scale, v_scale = torch.empty(2), torch.empty(2)
    calibrate_scales(k, v, k_scale, v_scale)
    assert torch.allclose(k_scale, torch.tensor([9.0, 0.5]) * CALIBRATION_HEADROOM / FP8_KV_MAX)
    assert bool((v_scale > 0).all())
    assert quantize_rows(k, k_scale).float().abs().max().item() == FP8_KV_MAX / CALIBRATION_HEADROOM


@pytest.mark.parametrize("device", DEVICES)
def test_scale_arguments_are_checked(device: str) -> None:
    batch = make_batch([(20, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                       device=device)  # fmt: skip
    fp8, k_scale, v_scale = _fp8_batch(batch)
    args = (fp8.k_new, fp8.v_new, fp8.k_cache, fp8.v_cache, fp8.meta.slot_mapping)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        tk.store_kvcache(*args)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        tk.paged_attention(fp8.q, fp8.k_cache, fp8.v_cache, fp8.meta, 0.1, k_scale=k_scale)
    with pytest.raises(ValueError, match=r"float32 \[num_kv_heads=2\]"):
        tk.store_kvcache(*args, k_scale.repeat(2), v_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn KV cache only"):
        tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.1, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        write_kv(fp8.k_new.cpu(), fp8.v_new.cpu(), fp8.k_cache.cpu(), fp8.v_cache.cpu(), fp8.meta.slot_mapping.cpu())
