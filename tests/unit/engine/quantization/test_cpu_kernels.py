"""torch's CPU quantized kernels and the layers over them: the kernels' exact semantics (pinned with known
codes against a dequantized matmul), llama.cpp's 4-bit blocks read without dequantizing (against the ``gguf``
library's own dequantization), float -> int4 / int8 rounding bounds, AWQ / GPTQ repacking, and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.quantization import QuantizationUnsupportedError, check_quantization_supported, cpu_linear
from gpu_workers.engine.quantization.cpu_linear import (
    DENSE_MIN_ROWS,
    CpuInt4Linear,
    CpuInt8Linear,
    int4_shape_problem,
    quantize_int4,
    quantize_int8,
)
from gpu_workers.engine.quantization.cpu_quant import int4_linear_to_cpu
from gpu_workers.engine.quantization.gguf_blocks import int4_parts, q8_0_float
from gpu_workers.engine.quantization.int4_config import parse_int4_config
from gpu_workers.engine.quantization.int4_formats import pack_along_rows
from gpu_workers.engine.quantization.int4_linear import Int4Linear

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: relative rounding <= 2^-9, two roundings <= 2^-8


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _expand(groups: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, K / size]`` per-group values -> ``[N, K]``."""
    return groups.repeat_interleave(size, dim=1)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_weight_is_codes_minus_8_times_scale_plus_zero(group: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    n, k = 48, 512
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, zero = torch.rand(k // group, n) * 0.1 + 0.01, torch.randn(k // group, n) * 0.1
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.stack([scale, zero], dim=-1).to(dtype)  # [K / group, N, 2], the activations' dtype
    x = torch.randn(5, k).to(dtype)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    s, z = _expand(sz[..., 0].float().t(), group), _expand(sz[..., 1].float().t(), group)
    want = x.float() @ ((codes - 8).float() * s + z).t()
    # fp32: summation order only; bf16: the output is rounded to bf16.
    torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-3)
    assert got.dtype == dtype
    # Other readings of the codes are far off (so the comparison above pins the convention).
    assert (x.float() @ ((codes.float() - z) * s).t() - got.float()).abs().max() > 1


def test_int8_kernel_weight_is_per_channel_scaled() -> None:
    torch.manual_seed(1)
    q = torch.randint(-128, 128, (40, 96), dtype=torch.int8)
    scales = torch.rand(40) * 0.01
    x = torch.randn(3, 96)
    got = torch.ops.aten._weight_int8pack_mm(x, q, scales)
    torch.testing.assert_close(got, x @ (q.float() * scales[:, None]).t(), rtol=1e-5, atol=1e-5)


def test_kernel_shape_limits_are_named() -> None:
    assert int4_shape_problem(48, 512, 32) is None
    assert "multiple of 16" in str(int4_shape_problem(40, 512, 32))
    assert "group size 16" in str(int4_shape_problem(48, 512, 16))
    assert "not a multiple of the group size 128" in str(int4_shape_problem(48, 576, 128))
    with pytest.raises(ValueError, match=r"int4 CPU layer \[40, 64\]: out_features=40"):
        CpuInt4Linear(64, 40, bias=False)


@pytest.mark.parametrize(
    ("n", "k", "group"),
    # Partial last blocks of 16, 32 and 48 rows after whole blocks of 32 (AVX2) or 64 (AVX512).
    [(48, 512, 32), (1536, 576, 32), (64, 256, 128), (16, 512, 256), (80, 288, 32), (96, 64, 32), (176, 64, 32)],
)
def test_int4_codes_unpack_into_the_kernels_own_weight(n: int, k: int, group: int) -> None:
    """The unpacked float32 weight a long prefill multiplies by is, bit for bit, the one the kernel's float32
    path multiplies by: the nibble order, the K-major layout and the per-group scale and zero all match, on the
    instruction set torch dispatches to here (and under ATEN_CPU_CAPABILITY=avx2 and default: see below)."""
    torch.manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, zero = torch.rand(n, k // group) * 0.1 + 1e-3, torch.randn(n, k // group) * 0.1
    layer = CpuInt4Linear.from_codes(codes, scale, zero, group)
    got = layer.dense_weight_t()
    assert got.shape == (k, n) and got.dtype == torch.float32
    assert torch.equal(got.t(), layer.dequantized_weight())
    # And against the codes themselves, so a swapped nibble order could not pass on both sides.
    s, z = _expand(scale.bfloat16().float(), group), _expand(zero.bfloat16().float(), group)
    torch.testing.assert_close(got.t(), (codes - 8).float() * s + z, rtol=0, atol=1e-6)


@pytest.fixture
def dense_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpacked float32 path on, as on AVX2, whatever this machine is (with bf16 dot products it unpacks into
    bfloat16; on AVX512 without them it is off)."""
    monkeypatch.setattr(cpu_linear, "DENSE_PATH", True)
    monkeypatch.setattr(cpu_linear, "DENSE_DTYPE", torch.float32)


@pytest.mark.usefixtures("dense_path")
def test_the_bfloat16_dense_path_is_the_kernels_weight_rounded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has bf16 dot products the weight is unpacked exactly, rounded to bfloat16 once, and multiplied
    by the bfloat16 input: a bfloat16 GEMM by the dequantized weight, in pieces or whole."""
    monkeypatch.setattr(cpu_linear, "DENSE_DTYPE", torch.bfloat16)
    torch.manual_seed(9)
    layer = CpuInt4Linear.from_float(torch.randn(112, 256) * 0.05, group_size=32)
    w = layer.dequantized_weight()
    x = torch.randn(DENSE_MIN_ROWS, 256).bfloat16()
    want = (x @ w.bfloat16().t()).float()
    torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(cpu_linear, "_SCRATCH_FLOATS", 64 * 256)  # two pieces and the partial block
    torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2)
    exact = x.float() @ w.t()  # within the two bfloat16 roundings of the float32 product
    assert float((layer(x).float() - exact).norm() / exact.norm()) < 2**-7


@pytest.mark.usefixtures("dense_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_layer_takes_the_dense_path_from_the_row_threshold_on(dtype: torch.dtype) -> None:
    """Below ``DENSE_MIN_ROWS`` rows the kernel multiplies (its bfloat16 rounding of the input shows); from it on,
    the unpacked float32 weight does, exactly as a float32 matmul by the dequantized weight. Both add the bias,
    keep the input's dtype and leading dimensions."""
    torch.manual_seed(7)
    layer = CpuInt4Linear.from_float(torch.randn(96, 256) * 0.05, bias=torch.randn(96).to(dtype), group_size=32)
    w = layer.dequantized_weight()
    for rows, dense in ((DENSE_MIN_ROWS - 1, False), (DENSE_MIN_ROWS, True), (3 * DENSE_MIN_ROWS, True)):
        x = torch.randn(1, rows, 256).to(dtype)
        out = layer(x)
        assert out.shape == (1, rows, 96) and out.dtype == dtype
        exact = (x.float().reshape(rows, 256) @ w.t()).to(dtype) + layer.bias
        if dense:
            torch.testing.assert_close(out, exact.reshape(1, rows, 96), rtol=1e-5, atol=1e-5)
        else:
            kernel = x.reshape(rows, 256).bfloat16().float() @ w.t() + layer.bias.float()
            torch.testing.assert_close(out.float().reshape(rows, 96), kernel, rtol=2e-2, atol=2e-2)
    if dtype == torch.float32:  # the kernel rounds a float32 input to bfloat16: the two paths differ there
        x = torch.randn(DENSE_MIN_ROWS, 256)
        exact = x @ w.t() + layer.bias
        below = layer(x[: DENSE_MIN_ROWS - 1])
        assert (below - exact[: DENSE_MIN_ROWS - 1]).abs().max() > 1e-4


@pytest.mark.usefixtures("dense_path")
def test_a_layer_larger_than_the_scratch_buffer_unpacks_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 64 columns at a time, a 112-row layer goes through whole blocks of the packer's layout (64
    rows on AVX512, 32 on AVX2) and its last partial block, and multiplies exactly as by the whole weight."""
    monkeypatch.setattr(cpu_linear, "_SCRATCH_FLOATS", 64 * 256)
    torch.manual_seed(8)
    layer = CpuInt4Linear.from_float(torch.randn(112, 256) * 0.05, group_size=64)
    layout = cpu_linear.pack_layout()
    assert layout is not None
    expected = [(0, 64), (64, 112)] if layout.block_n == 64 else [(0, 64), (64, 96), (96, 112)]
    assert layer._column_pieces() == expected
    w = layer.dequantized_weight()
    assert torch.equal(layer.dense_weight_t().t(), w)
    x = torch.randn(DENSE_MIN_ROWS, 256)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-5, atol=1e-5)


def _k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)
    raw[..., 2:4] = np.frombuffer(np.float16(0.003).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_gguf_4bit_blocks_are_read_as_codes_scales_and_zeros(qtype: T) -> None:
    rng = np.random.default_rng(2)
    rows, cols = 32, 512
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = _k_blocks(rows, cols, rng) if qtype == T.Q4_K else quants.quantize(w, qtype)
    want = torch.from_numpy(quants.dequantize(raw, qtype).reshape(rows, cols))
    codes, scale, zero = int4_parts(qtype.name, raw, rows, cols)
    assert codes.min() >= 0 and codes.max() <= 15
    got = (codes - 8).float() * _expand(scale, 32) + _expand(zero, 32)
    # float32 arithmetic in another order than the library's: within an ulp of the weights' magnitude.
    torch.testing.assert_close(got, want, rtol=0, atol=4e-7 * float(want.abs().max()))

    # The layer holds the same weight but for scale and zero rounded to bfloat16, and multiplies by it.
    layer = CpuInt4Linear.from_codes(codes, scale, zero, 32)
    held = layer.dequantized_weight()
    bound = BF16_EPS * (8 * _expand(scale, 32).abs() + _expand(zero, 32).abs())
    assert ((held - want).abs() <= bound + 1e-7).all()
    x = torch.randn(4, cols)
    out = layer(x)
    assert out.dtype == torch.float32
    ref = x.bfloat16().float() @ held.t()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_gguf_q8_0_blocks_are_read_as_the_library_dequantizes_them() -> None:
    w = np.random.default_rng(5).standard_normal((16, 96)).astype(np.float32)
    raw = quants.quantize(w, T.Q8_0)
    want = torch.from_numpy(quants.dequantize(raw, T.Q8_0).reshape(16, 96))
    assert torch.equal(q8_0_float(raw, 16, 96), want)


def test_float_to_int4_and_int8_stay_within_half_a_step() -> None:
    torch.manual_seed(3)
    w = torch.randn(64, 256) * 0.1
    w[3, :32] = 0.25  # a constant group
    codes, scale, zero = quantize_int4(w, 32)
    got = (codes - 8).float() * _expand(scale, 32) + _expand(zero, 32)
    assert ((got - w).abs() <= _expand(scale, 32) * 0.5 * (1 + 2 * BF16_EPS) + 1e-7).all()
    assert torch.equal(got[3, :32], w[3, :32])
    assert scale.bfloat16().float().equal(scale) and zero.bfloat16().float().equal(zero)

    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16
    err = (q.float() * s.float()[:, None] - w).abs()
    assert (err <= s.float()[:, None] * 0.5 + 1e-7).all()
    layer = CpuInt8Linear.from_float(w, bias=torch.arange(64.0))
    x = torch.randn(3, 256)
    ref = x.bfloat16().float() @ layer.dequantized_weight().t() + torch.arange(64.0)
    torch.testing.assert_close(layer(x), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_gptq_layer_repacks_onto_the_cpu_kernel(group_size: int) -> None:
    """An ``Int4Linear`` as the AWQ / GPTQ loader fills it (``(q - zero) * scale``, fp16 scales) holds the same
    weight once repacked, but for the bfloat16 rounding of scale and zero."""
    torch.manual_seed(4)
    cfg = parse_int4_config({"quant_method": "gptq", "group_size": group_size})
    layer = Int4Linear(256, 48, bias=True, cfg=cfg, dtype=torch.float32)
    groups = layer.zeros.shape[0]
    layer.qweight.copy_(pack_along_rows(torch.randint(0, 16, (256, 48))))
    layer.zeros.copy_(torch.randint(0, 16, (groups, 48), dtype=torch.uint8))
    layer.scales.copy_((torch.rand(groups, 48) * 0.02 + 0.001).half().float())
    layer.bias.data.normal_()
    cpu = int4_linear_to_cpu(layer)
    assert cpu.group_size == (256 if group_size == -1 else group_size)  # one group of 256 fits the kernel
    want = layer.dequantized_weight()
    s = want.abs().max()
    torch.testing.assert_close(cpu.dequantized_weight(), want, rtol=0, atol=float(BF16_EPS * 16 * s))
    torch.testing.assert_close(cpu.bias, layer.bias)


def test_act_order_gptq_is_refused_by_cpu_int4() -> None:
    cfg = parse_int4_config({"quant_method": "gptq", "group_size": 32, "desc_act": True})
    layer = Int4Linear(256, 48, bias=False, cfg=cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"act-order \(desc_act\).*leave quantization empty"):
        int4_linear_to_cpu(layer, "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("method", ["cpu-int8", "cpu-int4", "gguf"])
def test_cpu_methods_are_refused_off_the_cpu(method: str) -> None:
    with pytest.raises(QuantizationUnsupportedError, match=rf"quantization='{method}'.*needs device='cpu'"):
        check_quantization_supported(method, torch.device("cuda"))
    check_quantization_supported(method, torch.device("cpu"))
    # The engine config refuses it before anything loads, even where CUDA itself is missing.
    with pytest.raises(ValueError, match=r"needs device='cpu', not 'cuda'"):
        EngineConfig(model="some/model", device="cuda", quantization=method)


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_unpacking_follows_the_packers_layout_on_other_instruction_sets(capability: str) -> None:
    """The packer lays rows out by instruction set (blocks of 64 on AVX512, 32 on AVX2, pairs without vectors): run
    on a machine of each kind would be needed, so the other kinds are forced with ATEN_CPU_CAPABILITY in a fresh
    interpreter (an AVX512 machine served garbage from long prefills before the layout was followed)."""
    script = (
        "import torch\n"
        "from gpu_workers.engine.quantization.cpu_linear import CpuInt4Linear, pack_layout\n"
        "assert pack_layout() is not None, torch.backends.cpu.get_cpu_capability()\n"
        "for n in (16, 48, 96, 176, 1536):\n"
        "    codes = torch.randint(0, 16, (n, 64), dtype=torch.int32)\n"
        "    scale, zero = torch.rand(n, 2) * 0.1 + 1e-3, torch.randn(n, 2) * 0.1\n"
        "    layer = CpuInt4Linear.from_codes(codes, scale, zero, 32)\n"
        "    assert torch.equal(layer.dense_weight_t().t(), layer.dequantized_weight()), n\n"
        "from gpu_workers.engine.quantization import cpu_linear\n"
        "assert cpu_linear.DENSE_PATH, 'only AVX512 keeps long prefills on the kernel'\n"
        "print(torch.backends.cpu.get_cpu_capability(), pack_layout())\n"
    )
    root = str(Path(__file__).resolve().parents[4])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(capability.upper()), done.stdout


def test_long_prefills_unpack_into_bfloat16_where_the_cpu_has_bf16_dot_products() -> None:
    """Measured: on AVX2 the kernel loses to an unpacked float32 weight from 128 rows; with AVX512_BF16 it beats
    the float32 one at every size and loses to a bfloat16 one from about 130 rows; AVX512 without bf16 keeps it."""
    bf16 = torch.cpu._is_avx512_bf16_supported()
    assert cpu_linear.DENSE_DTYPE == (torch.bfloat16 if bf16 else torch.float32)
    assert cpu_linear.DENSE_PATH == (bf16 or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"))
    assert cpu_linear.DENSE_MIN_ROWS == (160 if bf16 else 128)
