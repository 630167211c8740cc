"""The Triton INT4 dequant-GEMM against the torch dequantize-then-matmul fallback, run through
Triton's interpreter on CPU tensors (compiled on a GPU), including ragged tiles and act-order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from needs import require

from gpu_workers.engine.quantization.int4_config import Int4Config
from gpu_workers.engine.quantization.int4_formats import dequantize, pack_along_rows
from gpu_workers.engine.quantization.int4_kernel import int4_matmul
from gpu_workers.engine.quantization.int4_linear import Int4Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_layer(k: int, n: int, group: int, act_order: bool, dtype: torch.dtype, seed: int) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Int4Linear(k, n, bias=True, cfg=Int4Config("gptq", group, desc_act=act_order), dtype=dtype)
    groups = k // group
    with torch.no_grad():
        layer.qweight.copy_(pack_along_rows(torch.randint(0, 16, (k, n), generator=gen)))
        layer.zeros.copy_(torch.randint(0, 16, (groups, n), generator=gen))
        layer.scales.copy_(torch.rand(groups, n, generator=gen) * 0.02 + 0.005)
        layer.bias.copy_(torch.randn(n, generator=gen))
        if layer.g_idx is not None:
            layer.g_idx.copy_((torch.randperm(k, generator=gen) // group).to(torch.int32))
    return layer.to(DEVICE)


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize(
    ("k", "n", "group", "act_order"), [(80, 48, 16, False), (96, 72, 32, True), (64, 8, 64, False)]
)
def test_kernel_matches_dequantize_then_matmul(m: int, k: int, n: int, group: int, act_order: bool) -> None:
    layer = _random_layer(k, n, group, act_order, torch.float32, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    weight = dequantize(layer.qweight, layer.zeros, layer.scales, layer.g_idx, torch.float32)
    got = int4_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, group)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Compiled fp32 dots may use TF32 on a GPU; the interpreter is exact fp32.
    tol = 2e-2 if DEVICE == "cuda" else 1e-4
    torch.testing.assert_close(got, x @ weight, rtol=tol, atol=tol)


def test_kernel_on_a_non_contiguous_input_and_an_empty_batch() -> None:
    layer = _random_layer(64, 40, 32, False, torch.float32, seed=3)
    x = torch.randn(64, 6).to(DEVICE).t()  # strided rows
    weight = layer.dequantized_weight()
    got = int4_matmul(x, layer.qweight, layer.scales, layer.zeros, None, 32)
    tol = 2e-2 if DEVICE == "cuda" else 1e-4
    torch.testing.assert_close(got, x @ weight.t(), rtol=tol, atol=tol)
    assert int4_matmul(x[:0], layer.qweight, layer.scales, layer.zeros, None, 32).shape == (0, 40)
    with pytest.raises(ValueError, match="32 features but qweight packs 64"):
        int4_matmul(torch.randn(2, 32).to(DEVICE), layer.qweight, layer.scales, layer.zeros, None, 32)


def test_layer_forward_keeps_leading_dims_and_adds_bias() -> None:
    layer = _random_layer(32, 16, 16, True, torch.float32, seed=5)
    x = torch.randn(2, 3, 32).to(DEVICE)
    want = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
    tol = 2e-2 if DEVICE == "cuda" else 1e-5
    torch.testing.assert_close(layer(x), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision_on_gpu(dtype: torch.dtype) -> None:
    layer = _random_layer(4096, 1024, 128, False, dtype, seed=7)
    x = torch.randn(24, 4096, device="cuda", dtype=dtype)
    got = layer(x)
    want = torch.nn.functional.linear(x.float(), layer.dequantized_weight(torch.float32), layer.bias.float())
    cosine = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(), dim=0).item()
    assert cosine >= 0.9999


def test_kernel_compiles_for_sm90_without_spills(tmp_path: Path) -> None:
    """The interpreter checks the arithmetic, not that the kernel compiles for a GPU: compile it for an
    H100 (sm_90) through Triton and ptxas on this machine (``int4_sm90_compile.py``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile afresh: a cache hit would skip ptxas
    script = Path(__file__).with_name("int4_sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode == 77:
        require(False, "the Triton internals the sm_90 compile check uses", run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert "11 compiled, 0 failed, 0 half-precision variants spill" in run.stdout
