"""The int4 x int8 CPU kernel (quantization/cpu_int4_q8.py): each instruction set's loop against a reference
written out in torch ops, every row independent of its batch, the layers that take it, and what is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs import needs

from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.quantization import cpu_int4_q8
from gpu_workers.engine.quantization.cpu_linear import (
    DENSE_MIN_ROWS,
    DENSE_PATH,
    INT8_DENSE_MIN_ROWS,
    CpuInt4Linear,
    use_int8_activations,
)

REPO_ROOT = Path(__file__).resolve().parents[4]
needs_kernel = needs(cpu_int4_q8.build_problem() is None, "the int4 x int8 kernel built", "apt-get install g++")


def _isas() -> list[int]:
    """The loops this CPU can run: the scalar reference always, AVX2 and VNNI where the CPU has them."""
    isas = [cpu_int4_q8.ISA_SCALAR]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        isas.append(cpu_int4_q8.ISA_AVX2)
    if cpu_int4_q8.kernel_isa() == cpu_int4_q8.ISA_VNNI:
        isas.append(cpu_int4_q8.ISA_VNNI)
    return isas


def _layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).bfloat16().float()
    zero = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).bfloat16().float()
    return codes, scale, zero


def _reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: activations quantized per group of 32 by their absolute maximum (ties
    to even), integer dots, each group scaled by d * dx, plus m times the group's exact sum."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    dx = xg.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xg * inv[..., None])
    dots = torch.einsum("rgi,ngi->rng", xq.double(), codes.view(-1, k // 32, 32).double())
    d, mn = scale.double(), (zero - 8 * scale).double()
    return (dots * d[None] * dx.double()[:, None]).sum(-1) + xg.sum(-1).double() @ mn.t()


@needs_kernel
@pytest.mark.parametrize(("rows", "k"), [(1, 192), (3, 160), (8, 192), (17, 96)])
def test_every_loop_computes_the_reference(rows: int, k: int) -> None:
    n = 48
    codes, scale, zero = _layer(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows)).bfloat16()
    q4, d, m = cpu_int4_q8.pack(codes, scale, zero)
    expected = _reference(x, codes, scale, zero)
    dequantized = x.double() @ ((codes.double() - 8) * scale.double().repeat_interleave(32, 1)
                                + zero.double().repeat_interleave(32, 1)).t()  # fmt: skip
    scalar = cpu_int4_q8.mm(x, q4, d, m, cpu_int4_q8.ISA_SCALAR)
    for isa in _isas():
        out = cpu_int4_q8.mm(x, q4, d, m, isa)
        assert torch.equal(out, scalar), f"isa {isa}: every loop gives the scalar loop's bits"
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"isa {isa}")
        # What the 8-bit activations cost against the exact float product: a few per mille to about 1 %.
        assert ((out.double() - dequantized).norm() / dequantized.norm()).item() < 0.03
        assert torch.equal(cpu_int4_q8.mm(x.float(), q4, d, m, isa), out)  # float32 inputs: the same values


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch() -> None:
    n, k = 64, 256
    codes, scale, zero = _layer(n, k, seed=7)
    q4, d, m = cpu_int4_q8.pack(codes, scale, zero)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    for isa in _isas():
        batch = cpu_int4_q8.mm(x, q4, d, m, isa)
        for i in (0, 4, 8):
            assert torch.equal(cpu_int4_q8.mm(x[i : i + 1], q4, d, m, isa)[0], batch[i]), (isa, i)
        assert torch.equal(cpu_int4_q8.mm(x.flip(0), q4, d, m, isa).flip(0), batch), isa


@needs_kernel
def test_the_rows_are_split_among_threads_without_changing_them() -> None:
    n, k = 256, 128
    codes, scale, zero = _layer(n, k, seed=3)
    q4, d, m = cpu_int4_q8.pack(codes, scale, zero)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int4_q8.mm(x, q4, d, m)
        torch.set_num_threads(2)
        assert torch.equal(cpu_int4_q8.mm(x, q4, d, m), one)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_a_layer_on_int8_activations_stays_close_to_its_float_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    bias = (torch.randn(96) * 0.01).bfloat16()  # the model's dtype, as loaded
    layer = CpuInt4Linear.from_float(weight, bias)
    kernel_only = CpuInt4Linear.from_float(weight, bias)
    exact, codes = layer.dequantized_weight(), layer.codes()
    assert use_int8_activations(torch.nn.Sequential(layer)) == 1 and layer.int8_activations
    assert "int8 activations" in repr(layer)
    # One copy of the weights: torch's packed form is dropped, and everything reads the kernel's.
    assert layer.packed.numel() == 0 and layer.scales_and_zeros.numel() == 0
    assert torch.equal(layer.codes(), codes)
    torch.testing.assert_close(layer.dequantized_weight(), exact, rtol=0, atol=1e-6)
    assert layer.use_int8_activations()  # again: nothing to do
    for rows in (1, 5, 64):
        x = torch.randn(2, rows, 128).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (2, rows, 96)
        ref = x.float() @ exact.t() + bias.float()
        assert ((out.float() - ref).norm() / ref.norm()).item() < 0.03
        assert not torch.equal(out, kernel_only(x))  # it did take the new path
    # Past torch's kernel's crossing (DENSE_MIN_ROWS) the int8 kernel still serves: it beats the unpacked weight.
    x = torch.randn(DENSE_MIN_ROWS, 128).bfloat16()
    through_kernel = cpu_int4_q8.mm(x, layer.q4, layer.q4_d, layer.q4_z).bfloat16() + bias
    assert torch.equal(layer(x), through_kernel)
    if INT8_DENSE_MIN_ROWS is not None and DENSE_PATH:
        # Its own crossing takes the unpacked weight's GEMM, unpacked from the kernel's layout; in and out of
        # inference mode in either order (its scratch buffers are shared by every layer of the thread).
        x = torch.randn(INT8_DENSE_MIN_ROWS, 128).bfloat16()
        with torch.inference_mode():
            served = layer(x)
        torch.testing.assert_close(layer(x).float(), kernel_only(x).float(), rtol=0.02, atol=0.02)
        assert torch.equal(layer(x), served)
    # New codes reach the kernel's copy.
    layer.set_codes(codes.flip(0).int(), torch.full((96, 4), 0.01), torch.zeros(96, 4))
    assert layer.int8_activations and torch.equal(layer.codes(), codes.flip(0))


def test_shapes_the_kernel_does_not_take_stay_on_torchs_kernel() -> None:
    wide = CpuInt4Linear.from_float(torch.randn(32, 128), group_size=64)  # the kernel's groups are 32
    assert not wide.use_int8_activations() and not wide.int8_activations
    with pytest.raises(ValueError, match="multiples of"):
        cpu_int4_q8.pack(torch.zeros(12, 96, dtype=torch.int32), torch.ones(12, 3), torch.zeros(12, 3))
    with pytest.raises(ValueError, match="multiples of"):
        cpu_int4_q8.pack(torch.zeros(16, 80, dtype=torch.int32), torch.ones(16, 2), torch.zeros(16, 2))


def test_settings_are_checked_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown cpu_int4_activations 'int4'"):
        EngineConfig(model=str(tmp_path), cpu_int4_activations="int4")
    with pytest.raises(ValueError, match="needs device='cpu'"):
        EngineConfig(model=str(tmp_path), device="cuda", cpu_int4_activations="int8")
    with pytest.raises(ValueError, match="unknown cpu_int4_activations"):
        cpu_int4_q8.wanted("fp8")
    assert cpu_int4_q8.wanted("bfloat16") is False


@needs_kernel
@pytest.mark.parametrize(("capability", "expected"), [("avx2", ["True", "AVX2"]), ("default", ["False", "scalar"])])
def test_auto_takes_the_kernel_wherever_torch_dispatches_to_vectors(capability: str, expected: list[str]) -> None:
    """ "auto" follows the ISA torch dispatches to (a fresh interpreter: ATen reads ATEN_CPU_CAPABILITY once): the
    kernel from AVX2 on, torch's own kernel without vector instructions (the scalar loop is only a reference)."""
    code = "from gpu_workers.engine.quantization import cpu_int4_q8 as q; print(q.wanted('auto'), q.isa_name())"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=180, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == expected
    vectors = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert cpu_int4_q8.wanted("auto") is vectors
