"""Quantized weights: layer swapping, accuracy against the float model, memory accounting and the
device/package checks, on a tiny random Llama built with transformers (CPU), plus one GPU test."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from needs import needs
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from gpu_workers.engine.quantization import (
    CPU_QUANTIZATIONS,
    SUPPORTED_QUANTIZATIONS,
    BitsAndBytesUnavailableError,
    CpuInt4Linear,
    CpuInt8Linear,
    Fp8Linear,
    QuantizationUnsupportedError,
    check_quantization_supported,
    quantize_model,
    weight_memory_bytes,
)
from gpu_workers.engine.quantization import fp8 as fp8_mod

try:
    import bitsandbytes as bnb
except ImportError:  # the GPU image has none unless a wheel is carried: fp8 is still tested there
    bnb = None

needs_bnb = needs(bnb is not None, "bitsandbytes", "pip install -e '.[dev]'")
# Every method, the bnb ones skipped (not the whole module) where bitsandbytes is missing.
METHODS = [pytest.param(m, marks=needs_bnb) if m.startswith("bnb") else m for m in SUPPORTED_QUANTIZATIONS]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPECTED_TYPE: dict[str, type[nn.Module]] = {"fp8": Fp8Linear, "cpu-int8": CpuInt8Linear, "cpu-int4": CpuInt4Linear}
if bnb is not None:
    EXPECTED_TYPE |= {"bnb-int8": bnb.nn.Linear8bitLt, "bnb-nf4": bnb.nn.Linear4bit}
# Lower bounds on the cosine similarity of all logits against the float32 model. Measured on this
# model and prompt set: int8 0.99998, fp8 0.99947, nf4 0.99624 (0.98556 with the biases left at zero);
# cpu-int8 0.99998, cpu-int4 0.99663 (bf16 activations in the projections, the rest of the model fp32).
MIN_LOGIT_COSINE = {"bnb-int8": 0.99, "fp8": 0.99, "bnb-nf4": 0.98, "cpu-int8": 0.99, "cpu-int4": 0.98}
# Upper bounds on (quantised projection bytes) / (fp32 projection bytes). 8-bit formats store 1 byte
# plus a 4-byte scale per output row; NF4 half a byte plus a 4-byte absmax per 64 weights; cpu-int8 1 byte
# plus a 2-byte scale per row; cpu-int4 half a byte plus a 2-byte scale and zero per 32 weights; biases stay
# fp32. Measured: int8 0.2589, fp8 0.2589, nf4 0.1436, cpu-int8 0.2554, cpu-int4 0.1584.
MAX_LINEAR_MEMORY_RATIO = {"bnb-int8": 0.27, "fp8": 0.27, "bnb-nf4": 0.15, "cpu-int8": 0.26, "cpu-int4": 0.17}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _config() -> LlamaConfig:
    # attention_bias=True gives q/k/v/o biases, as Qwen2's qkv projections have.
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        attention_bias=True,
    )


@pytest.fixture(scope="module")
def float_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        # Random init leaves biases at zero; give them values so "bias kept" is observable in logits.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module")
def prompts() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 512, (4, 24), generator=gen)


@pytest.fixture(scope="module")
def float_logits(float_model: LlamaForCausalLM, prompts: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return float_model(prompts).logits


def _linear_bytes(model: nn.Module) -> int:
    return sum(weight_memory_bytes(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS)


@pytest.mark.parametrize("method", METHODS)
def test_quantize_llama_swaps_layers_keeps_logits_and_shrinks_memory(
    method: str, float_model: LlamaForCausalLM, prompts: torch.Tensor, float_logits: torch.Tensor
) -> None:
    model = copy.deepcopy(float_model)
    float_bytes, float_linear_bytes = weight_memory_bytes(model), _linear_bytes(model)

    assert quantize_model(model, method) is model

    swapped = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    assert len(swapped) == 2 * len(PROJECTIONS)
    assert all(isinstance(m, EXPECTED_TYPE[method]) for m in swapped)
    assert type(model.lm_head) is nn.Linear  # skipped by default
    assert isinstance(model.model.embed_tokens, nn.Embedding)

    with torch.no_grad():
        logits = model(prompts).logits
    cosine = F.cosine_similarity(logits.flatten(), float_logits.flatten(), dim=0).item()
    assert cosine >= MIN_LOGIT_COSINE[method], f"{method}: logits cosine {cosine:.5f}"

    linear_ratio = _linear_bytes(model) / float_linear_bytes
    assert linear_ratio <= MAX_LINEAR_MEMORY_RATIO[method], f"{method}: memory ratio {linear_ratio:.3f}"
    assert weight_memory_bytes(model) < float_bytes


@pytest.mark.parametrize("method", METHODS)
def test_bias_is_kept(method: str, float_model: LlamaForCausalLM) -> None:
    model = copy.deepcopy(float_model)
    quantize_model(model, method)
    attn_q, ref_q = model.model.layers[0].self_attn.q_proj, float_model.model.layers[0].self_attn.q_proj
    assert attn_q.bias is not None
    torch.testing.assert_close(attn_q.bias.float(), ref_q.bias)
    # gate_proj has no bias in Llama and must not grow one.
    assert model.model.layers[0].mlp.gate_proj.bias is None

    # The bias reaches the output: a zero input gives exactly the bias back.
    with torch.no_grad():
        out = attn_q(torch.zeros(2, attn_q.in_features))
    torch.testing.assert_close(out, ref_q.bias.expand(2, -1), atol=1e-6, rtol=0)


def test_skip_keeps_matching_layers_in_float(float_model: LlamaForCausalLM) -> None:
    model = copy.deepcopy(float_model)
    quantize_model(model, "fp8", skip=lambda name: ".mlp." in name or name.endswith("lm_head"))
    layer = model.model.layers[1]
    assert type(layer.mlp.down_proj) is nn.Linear
    assert type(layer.mlp.gate_proj) is nn.Linear
    assert isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert type(model.lm_head) is nn.Linear


def test_skip_nothing_quantizes_lm_head_too(float_model: LlamaForCausalLM) -> None:
    model = copy.deepcopy(float_model)
    quantize_model(model, "fp8", skip=lambda name: False)
    assert isinstance(model.lm_head, Fp8Linear)


def test_unknown_method_is_a_value_error(float_model: LlamaForCausalLM) -> None:
    # (awq and gptq are INT4 checkpoints; test_engine_int4.py covers them.)
    with pytest.raises(ValueError, match=r"unknown quantization method 'hqq'.*bnb-int8, bnb-nf4, fp8, .*awq, gptq"):
        check_quantization_supported("hqq", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_model(copy.deepcopy(float_model), "int4")


def test_quantizing_twice_is_refused(float_model: LlamaForCausalLM) -> None:
    model = quantize_model(copy.deepcopy(float_model), "fp8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "bnb-int8")


@needs_bnb  # it also checks that bnb methods ignore the capability
def test_fp8_on_pre_ada_gpu_names_capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(QuantizationUnsupportedError, match=r"compute capability >= 8\.9.*A100.*8\.0"):
        check_quantization_supported("fp8", torch.device("cuda", 0))
    # bnb methods do not depend on the capability.
    check_quantization_supported("bnb-int8", torch.device("cuda", 0))


def test_fp8_allowed_on_hopper_and_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    check_quantization_supported("fp8", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_quantization_supported("fp8", torch.device("cuda", 0))


def test_missing_bitsandbytes_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    for method in ("bnb-int8", "bnb-nf4"):
        with pytest.raises(BitsAndBytesUnavailableError, match="pip install bitsandbytes") as info:
            check_quantization_supported(method, torch.device("cpu"))
        assert isinstance(info.value.__cause__, ImportError)
    check_quantization_supported("fp8", torch.device("cpu"))


def test_fp8_linear_pads_unaligned_shapes_and_keeps_leading_dims() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(30, 50)
    layer = Fp8Linear.from_linear(linear)
    assert tuple(layer.weight.shape) == (64, 32)  # rounded up to multiples of 16 for cuBLASLt
    x = torch.randn(2, 3, 30)
    with torch.no_grad():
        out, ref = layer(x), linear(x)
    assert out.shape == (2, 3, 50)
    assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.999
    with pytest.raises(ValueError, match="expected last dim 30"):
        layer(torch.randn(2, 31))


def test_fp8_linear_quantizes_activations_per_token() -> None:
    # Rows of very different magnitude: a per-tensor activation scale would flush the small row to
    # zero in e4m3, a per-token one keeps both accurate.
    torch.manual_seed(3)
    linear = nn.Linear(64, 32, bias=False)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 64) * torch.tensor([[1e4], [1e-4]])
    with torch.no_grad():
        out, ref = layer(x), linear(x)
    for row in range(2):
        assert F.cosine_similarity(out[row], ref[row], dim=0) > 0.999


def test_fp8_linear_keeps_fp8_storage_through_dtype_casts() -> None:
    torch.manual_seed(4)
    linear = nn.Linear(64, 48)
    model = nn.Sequential(Fp8Linear.from_linear(linear))
    model.to(torch.bfloat16)
    layer = model[0]
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16
    x = torch.randn(5, 64)
    with torch.no_grad():
        out = model(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert F.cosine_similarity(out.float().flatten(), linear(x).detach().flatten(), dim=0) > 0.99


def test_fp8_dequantized_fallback_matches_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(5)
    layer = Fp8Linear.from_linear(nn.Linear(64, 48))
    x = torch.randn(3, 64)
    with torch.no_grad():
        fast = layer(x)
        monkeypatch.setitem(fp8_mod._gemm_modes, ("cpu", torch.float32), "dequantized")
        slow = layer(x)
    assert F.cosine_similarity(fast.flatten(), slow.flatten(), dim=0) > 0.999


def test_fp8_gemm_mode_on_old_gpu_is_the_dequantized_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(fp8_mod, "_gemm_modes", {})
    assert fp8_mod.gemm_mode(torch.device("cuda", 0), torch.float16) == "dequantized"
    assert fp8_mod.gemm_mode(torch.device("cpu"), torch.float32) == "fused_bias"


@needs_bnb
def test_weight_memory_bytes_counts_quantized_storage_exactly() -> None:
    linear = nn.Linear(64, 32)  # 2048 weights, 32 outputs
    bias_bytes = 32 * 4
    assert weight_memory_bytes(linear) == 2048 * 4 + bias_bytes

    model = nn.Sequential(copy.deepcopy(linear))
    quantize_model(model, "fp8", skip=lambda name: False)
    assert weight_memory_bytes(model) == 2048 + 32 * 4 + bias_bytes  # fp8 data + fp32 row scales

    model = quantize_model(nn.Sequential(copy.deepcopy(linear)), "bnb-int8", skip=lambda name: False)
    int8_bytes = 2048 + 32 * 4 + bias_bytes  # int8 data + fp32 row scales (SCB)
    assert weight_memory_bytes(model) == int8_bytes
    with torch.no_grad():
        model(torch.randn(2, 64))  # Linear8bitLt moves CB/SCB onto its state at first forward
    assert weight_memory_bytes(model) == int8_bytes

    model = quantize_model(nn.Sequential(copy.deepcopy(linear)), "bnb-nf4", skip=lambda name: False)
    # packed nibbles + one fp32 absmax per 64-weight block + the 16-entry fp32 NF4 code table
    assert weight_memory_bytes(model) == 2048 // 2 + (2048 // 64) * 4 + 16 * 4 + bias_bytes


def test_weight_memory_bytes_counts_tied_weights_once() -> None:
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    assert weight_memory_bytes(nn.ModuleList([emb, head])) == 100 * 16 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", METHODS)
def test_quantize_llama_on_gpu(method: str, float_model: LlamaForCausalLM, prompts: torch.Tensor) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    if method in CPU_QUANTIZATIONS:  # kept for torch's CPU kernels: refused on a GPU with the formats to use there
        with pytest.raises(QuantizationUnsupportedError, match=r"needs device='cpu'.*AWQ / GPTQ"):
            quantize_model(copy.deepcopy(float_model).to(device), method)
        return
    if method == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        with pytest.raises(QuantizationUnsupportedError, match="compute capability"):
            check_quantization_supported(method, device)
        return
    model = copy.deepcopy(float_model).to(device=device, dtype=torch.bfloat16)
    ids = prompts.to(device)
    with torch.no_grad():
        ref = model(ids).logits.float()
    before = weight_memory_bytes(model)
    quantize_model(model, method)
    assert all(isinstance(m, EXPECTED_TYPE[method]) for n, m in model.named_modules() if n.endswith("q_proj"))
    assert next(m for m in model.modules() if isinstance(m, EXPECTED_TYPE[method])).weight.device == device
    if method == "fp8":
        assert fp8_mod.gemm_mode(device, torch.bfloat16) != "dequantized"  # real FP8 tensor-core GEMMs
    with torch.no_grad():
        logits = model(ids).logits.float()
    cosine = F.cosine_similarity(logits.flatten(), ref.flatten(), dim=0).item()
    assert cosine >= MIN_LOGIT_COSINE[method] - 0.01, f"{method} on {device}: cosine {cosine:.5f}"
    assert weight_memory_bytes(model) < before
