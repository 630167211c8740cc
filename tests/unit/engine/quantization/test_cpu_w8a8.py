"""The W8A8 LM head (``cpu_w8a8.py``): its error against the float product, its per-row independence from the
batch, its bias and shapes, the codes of an int8 layer kept as they are, and the settings' refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.quantization.cpu_linear import CpuInt4Linear, CpuInt8Linear
from gpu_workers.engine.quantization.cpu_w8a8 import CpuW8A8Linear, quantize_lm_head, w8a8_problem

pytestmark = pytest.mark.skipif(w8a8_problem() is not None, reason=f"no W8A8 kernel here: {w8a8_problem()}")


def _weight(n: int = 1000, k: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_the_product_is_the_float_one_within_two_int8_roundings() -> None:
    w, x = _weight(), torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    layer = CpuW8A8Linear.from_float(w)
    want = x @ w.t()
    got = layer(x)
    # Each side rounds by at most half a step of 1/127 of its row's maximum; the sums' relative error stays ~1 %.
    assert float((got - want).norm() / want.norm()) < 0.02
    assert float((got - want).norm() / want.norm()) > 0  # it is quantized: not the float product itself
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_row_gets_the_same_bits_in_any_batch_and_at_any_place() -> None:
    """Rows are quantized each by its own maximum and summed in integers: the deterministic mode keeps this head."""
    layer = CpuW8A8Linear.from_float(_weight(n=512, k=576))
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(1, 576, generator=gen).bfloat16()
    outs = set()
    for m in (1, 2, 3, 8, 16, 17, 64, 129):
        for place in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, 576, generator=gen).bfloat16() * (place + 1)
            x[place] = row[0]
            outs.add(tuple(layer(x)[place].float().tolist()))
    assert len(outs) == 1


def test_dtype_shape_bias_and_a_zero_row() -> None:
    w, bias = _weight(n=48, k=32), torch.randn(48)
    layer = CpuW8A8Linear.from_float(w, bias)
    x = torch.randn(2, 3, 32).bfloat16()
    x[0, 1] = 0
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 48)
    assert torch.equal(out[0, 1], bias.bfloat16())  # a zero row: nothing but the bias, and no NaN
    assert float((out.float() - (x.float() @ w.t() + bias)).abs().max()) < 0.05


def test_an_int8_layer_keeps_its_codes_and_an_int4_layer_is_dequantized_first() -> None:
    w = _weight(n=64, k=64)
    int8 = CpuInt8Linear.from_float(w)
    x = torch.randn(4, 64).bfloat16()
    from_codes = CpuW8A8Linear.from_module(int8)
    exact = x.float() @ int8.dequantized_weight().t()
    # The weights are the int8 layer's own: only the activations' rounding is left.
    assert float((from_codes(x).float() - exact).norm() / exact.norm()) < 0.01
    int4 = CpuInt4Linear.from_float(w)
    assert float((CpuW8A8Linear.from_module(int4)(x).float() - x.float() @ int4.dequantized_weight().t()).norm()
                 / exact.norm()) < 0.02  # fmt: skip
    with pytest.raises(ValueError, match="linear LM head"):
        CpuW8A8Linear.from_module(nn.Embedding(4, 4))


def test_quantize_lm_head_leaves_a_tied_embedding_float() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.lm_head.weight = self.embed.weight

    model = Tied()
    before = model.embed.weight.detach().clone()
    quantize_lm_head(model, "w8a8")
    assert isinstance(model.lm_head, CpuW8A8Linear)
    assert torch.equal(model.embed.weight, before)
    with pytest.raises(ValueError, match="unknown lm_head_quantization"):
        quantize_lm_head(model, "int4")


def test_the_setting_is_refused_by_name_where_it_cannot_run() -> None:
    assert EngineConfig(model="m", lm_head_quantization="w8a8").lm_head_quantization == "w8a8"
    with pytest.raises(ValueError, match="unknown lm_head_quantization 'int3'"):
        EngineConfig(model="m", lm_head_quantization="int3")
    with pytest.raises(ValueError, match="needs device='cpu'"):
        EngineConfig(model="m", device="cuda", lm_head_quantization="w8a8")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 does not support lm_head_quantization"):
        EngineConfig(model="m", tensor_parallel_size=2, lm_head_quantization="w8a8")


def test_weight_accounting_counts_the_packed_head() -> None:
    from gpu_workers.engine.quantization import weight_memory_bytes

    model = nn.Sequential(nn.Linear(32, 64, bias=False))
    float_bytes = weight_memory_bytes(model)
    model[0] = CpuW8A8Linear.from_module(model[0])
    assert weight_memory_bytes(model) == 64 * 32 + 4 * 64 < float_bytes
