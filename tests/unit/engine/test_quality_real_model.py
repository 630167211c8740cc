"""Quality on the real SmolLM2-135M-Instruct (slow): greedy tokens equal transformers' on chat prompts under prefix
caching, chunked prefill and preemption (torch backend; Triton interpreted, very few tokens), and teacher-forced
thresholds on ``tests/data/quality_text.txt`` for the FP8 KV cache, bf16, bitsandbytes int8 against its
transformers peer and the weights kept quantized on the CPU (``gguf``, ``cpu-int4``, ``cpu-int8``). The measures
live in ``benchmarks/quality_measures.py``; the figures are in docs/quality.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from needs import needs, require_import, require_triton_interpreter
from transformers import AutoTokenizer

from benchmarks import quality_measures as qm
from gpu_workers.engine.quantization import cpu_int4_q8

pytestmark = pytest.mark.slow

GREEDY_TOKENS = 12

needs_int4_q8 = needs(cpu_int4_q8.available(), "the int4 x int8 kernel (AVX2, a C++ compiler)", "apt-get install g++")


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = qm.model_path()
    qm.make_llm(path, dtype="float32")  # converts the GGUF into its cached .hf folder on the first run
    return path


@pytest.fixture(scope="module")
def reference(gguf: Path) -> qm.Reference:
    return qm.Reference(qm.hf_folder(gguf))


@pytest.fixture(scope="module")
def text(reference: qm.Reference) -> list[int]:
    ids = qm.text_ids(AutoTokenizer.from_pretrained(str(reference.folder)))
    assert 500 <= len(ids) <= 700
    return ids


@pytest.fixture(scope="module")
def prompts(reference: qm.Reference) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(reference.folder))
    return [qm.chat_ids(tokenizer, q) for q in qm.CHAT_QUESTIONS[:3]]


@pytest.mark.parametrize("setup", list(qm.GREEDY_SETUPS))
def test_greedy_equals_transformers(setup: str, gguf: Path, reference: qm.Reference, prompts: list[list[int]]) -> None:
    check = qm.check_greedy(gguf, reference, prompts, GREEDY_TOKENS, setup, **qm.GREEDY_SETUPS[setup])
    assert check.equal == len(prompts), check
    if "prefix" in setup:
        assert check.prefix_hit_tokens >= 2 * 32  # the later prompts reuse the system prompt's full blocks
    if "preemption" in setup:
        assert check.preemptions > 0


def test_greedy_equals_transformers_on_triton(gguf: Path, reference: qm.Reference, prompts: list[list[int]]) -> None:
    require_import("triton")
    from gpu_workers.engine.attention.triton_kernels import INTERPRETED

    if not torch.cuda.is_available():
        require_triton_interpreter(INTERPRETED)
    check = qm.check_greedy(gguf, reference, prompts[:2], 2, "triton", staggered=True, attention_backend="triton")
    assert check.equal == 2 and check.prefix_hit_tokens > 0, check


def test_fp8_kv_cache_stays_close(gguf: Path, reference: qm.Reference, text: list[int]) -> None:
    # Target 0.98 agreement is missed on this model (measured 0.949; docs/quality.md says why): this guards it.
    result = qm.measure_engine(gguf, reference, text, dtype="float32", kv_cache_dtype="fp8")
    assert result.top1_agreement >= 0.93, result
    assert abs(result.perplexity_change) <= 0.02, result


def test_bf16_stays_close(gguf: Path, reference: qm.Reference, text: list[int]) -> None:
    result = qm.measure_engine(gguf, reference, text, dtype="bfloat16")
    assert result.top1_agreement >= 0.95, result
    assert abs(result.perplexity_change) <= 0.01, result


def test_int8_at_least_as_good_as_transformers(gguf: Path, reference: qm.Reference, text: list[int]) -> None:
    require_import("bitsandbytes")
    require_import("accelerate")  # transformers' bitsandbytes loading needs it
    engine = qm.measure_engine(gguf, reference, text, dtype="float32", quantization="bnb-int8")
    peer = qm.measure_hf(reference, "bnb-int8", text)
    assert engine.top1_agreement >= peer.top1_agreement, (engine, peer)
    assert abs(engine.perplexity_change) <= 0.01, engine


# Measured (docs/quality.md): gguf 0.9734 / -0.13%, cpu-int4 0.9652 / -0.23%, cpu-int8 0.9468 / -0.14%; the
# dequantized model in bf16 scores 0.9693 / -0.46%: keeping the Q4_1 blocks costs no more than bf16 itself.
# The W8A8 LM head over cpu-int4: 0.955 / -0.68% (its activations' rounding flips a few near-ties; the perplexity
# stays). With the 4-bit layers on int8 activations too (`up`'s CPU default; llama.cpp's own arithmetic): 0.914 /
# +1.6% here; the kernel's first form gave 0.937 / +2.6% with every kernel capped at AVX2.
@pytest.mark.parametrize(
    ("quantization", "lm_head", "activations", "min_agreement", "max_perplexity_change"),
    [
        ("gguf", None, "bfloat16", 0.95, 0.01),
        ("cpu-int4", None, "bfloat16", 0.95, 0.01),
        ("cpu-int4", "w8a8", "bfloat16", 0.94, 0.01),
        ("cpu-int8", None, "bfloat16", 0.93, 0.01),
        pytest.param("cpu-int4", "w8a8", "int8", 0.89, 0.035, marks=needs_int4_q8),
    ],
)
def test_kept_quantized_stays_close(
    quantization: str,
    lm_head: str | None,
    activations: str,
    min_agreement: float,
    max_perplexity_change: float,
    gguf: Path,
    reference: qm.Reference,
    text: list[int],
) -> None:
    result = qm.measure_engine(
        gguf, reference, text, quantization=quantization, lm_head_quantization=lm_head, cpu_int4_activations=activations
    )
    assert result.top1_agreement >= min_agreement, result
    assert abs(result.perplexity_change) <= max_perplexity_change, result
