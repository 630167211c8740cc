"""The deterministic mode: a prompt's greedy and seeded tokens alone equal its tokens in a crowd (chunked prefill,
prefix-cache hits, preemption forced) and after a resume from delivered tokens; the kernels' per-row invariance it
rests on; and the keyed draws of seeded sampling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from needs import needs

from gpu_workers.engine import LLM, RequestOutput, SamplingParams
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.core.counter_rng import SeededStream, Stream, draw_key
from gpu_workers.engine.core.scheduler import ScheduledBatch
from gpu_workers.engine.execution.batch_invariant import invariant_linear, min_rows
from gpu_workers.engine.execution.cpu_decode_compile import cxx_compiler
from gpu_workers.engine.quantization import cpu_int4_q8
from gpu_workers.engine.quantization.cpu_linear import CpuInt4Linear

from .conftest import random_prompts

needs_compiler = needs(cxx_compiler() is not None, "a C++ compiler for Inductor", "apt-get install g++")
needs_int4_q8 = needs(cpu_int4_q8.available(), "the int4 x int8 kernel (AVX2, a C++ compiler)", "apt-get install g++")

# Logprobs too: tokens of a random model rarely flip, but a logprob shows any difference in the logits, bit for bit.
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=11, ignore_eos=True, logprobs=0)
Answer = tuple[list[int], list[float]]
# Mixed lengths (1 to 150 tokens), some longer than a crowded step's token budget.
PROMPTS = [p for p, _ in random_prompts(seed=21)[:11]]


def _distinct_results(f: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype) -> int:
    """How many different outputs one row gets, placed at several places in batches of 1 to 300 rows."""
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(1, k, generator=gen).to(dtype)
    outs: list[torch.Tensor] = []
    for m in (1, 2, 3, 5, 8, 15, 16, 17, 31, 64, 129, 300):
        for place in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=gen).to(dtype)
            x[place] = row[0]
            outs.append(f(x)[place])
    return len({tuple(o.float().tolist()) for o in outs})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_dense_linear_gives_a_row_the_same_result_in_any_batch(dtype: torch.dtype) -> None:
    """The property the mode's dense linears rest on, checked on this machine's build: from ``min_rows`` rows on, a
    row's product does not depend on how many rows come with it nor where it sits; the plain product does."""
    layer = torch.nn.Linear(576, 1536, bias=True).to(dtype)
    assert _distinct_results(lambda x: invariant_linear(layer, x), 576, dtype) == 1
    assert min_rows(dtype) > 1  # a single row (a GEMV) sums in another order than the GEMM


def test_the_int4_kernel_gives_a_row_the_same_result_in_any_batch() -> None:
    layer = CpuInt4Linear.from_float(torch.randn(256, 576))
    layer.batch_invariant = True  # the mode keeps long inputs on the kernel (AVX2 would unpack them)
    assert _distinct_results(layer, 576, torch.bfloat16) == 1


def test_keyed_draws_depend_on_seed_position_and_use_only() -> None:
    a, b = SeededStream(5, "cpu"), SeededStream(5, "cpu")
    row_a, row_b = torch.empty(1000), torch.empty(1000)
    b.exponential_(torch.empty(1000), 3)  # an earlier draw does not move a later one
    assert torch.equal(a.exponential_(row_a, 7), b.exponential_(row_b, 7))
    assert not torch.equal(row_a, SeededStream(5, "cpu").exponential_(torch.empty(1000), 8))
    assert not torch.equal(row_a, SeededStream(6, "cpu").exponential_(torch.empty(1000), 7))
    assert torch.equal(a.uniform([4, 9]), torch.cat([b.uniform([4]), b.uniform([9])]))
    assert len({draw_key(5, 7, s) for s in Stream}) == len(Stream)
    with pytest.raises(ValueError, match="position"):
        draw_key(5, -1, Stream.TOKEN)


def _answer(out: RequestOutput) -> Answer:
    return out.token_ids, [lp.logprob for lp in out.logprobs or []]


def _crowd(make_llm: Callable[..., LLM], model: Path, params: SamplingParams, **kwargs: object) -> list[Answer]:
    """Every prompt twice at once (the second copy's prompt from the prefix cache), 16 tokens a step (chunked
    prefill), in a KV cache too small for the batch (preemption and recompute)."""
    crowd = make_llm(model, max_num_batched_tokens=16, num_kv_blocks=20, max_model_len=256, **kwargs)
    scheduler = crowd.engine.scheduler
    schedule, preempted = scheduler.schedule, []

    def counting_schedule() -> ScheduledBatch:
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    outs = crowd.generate(PROMPTS + PROMPTS, params)
    assert preempted, "the crowd was meant to preempt"
    return [_answer(o) for o in outs]


SETUPS = [
    dict(dtype="bfloat16", quantization="cpu-int4"),
    dict(dtype="bfloat16", quantization="cpu-int4", lm_head_quantization="w8a8"),  # as `up` serves on the CPU
    dict(dtype="float32"),
]


@pytest.mark.slow  # 13-33 s each on the shared 2-core box
@pytest.mark.parametrize("setup", SETUPS, ids=["bf16-int4", "bf16-int4-w8a8", "fp32"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["mode", "no-mode"])
def test_answers_alone_equal_answers_in_a_crowd_only_in_the_mode(
    setup: dict[str, str], deterministic: bool, make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    model = model_dir("llama")
    alone = make_llm(model, deterministic=deterministic, **setup)
    for params in (GREEDY, SEEDED):
        expected = [_answer(alone.generate([p], params)[0]) for p in PROMPTS]
        together = _crowd(make_llm, model, params, deterministic=deterministic, **setup)
        differ = [i for i, out in enumerate(together) if out != expected[i % len(PROMPTS)]]
        if deterministic:
            assert differ == [], f"{len(differ)} of {len(together)} differ ({params.temperature=})"
        else:  # what the mode is for: without it the crowd's logits are not the lone prompt's
            assert len(differ) > len(together) // 2, f"only {len(differ)} of {len(together)} differ"


@pytest.mark.slow
@needs_compiler
def test_compiled_steps_in_a_crowd_answer_as_alone_in_the_mode(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    """Every step through the one compiled graph, prompt tokens as rows attending alone (as `up` serves on the
    CPU, with the mode on): alone, in a crowd and resumed from delivered tokens, the same tokens and logprobs."""
    model = model_dir("llama")
    setup = dict(SETUPS[1], compile_cpu_decode=True, deterministic=True)
    alone = make_llm(model, **setup)
    compiled = alone.engine.runner.compiled_decode
    assert compiled is not None and compiled.invariant, "the mode should compile its steps here"
    for params in (GREEDY, SEEDED):
        expected = [_answer(alone.generate([p], params)[0]) for p in PROMPTS]
        together = _crowd(make_llm, model, params, **setup)
        differ = [i for i, out in enumerate(together) if out != expected[i % len(PROMPTS)]]
        assert differ == [], f"{len(differ)} of {len(together)} differ ({params.temperature=})"
        for prompt, (clean, logprobs) in list(zip(PROMPTS, expected, strict=True))[2:5]:
            cut = len(clean) // 3
            rest = dataclasses.replace(params, max_tokens=len(clean) - cut)
            assert _answer(alone.generate([prompt + clean[:cut]], rest)[0]) == (clean[cut:], logprobs[cut:])


@pytest.mark.slow
@needs_int4_q8
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_int8_activations_in_a_crowd_answer_as_alone_in_the_mode(
    compiled: bool, make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    """The 4-bit layers on the int4 x int8 kernel (as `up` serves on AVX2): each row is quantized and summed alone,
    so the mode keeps it for every row, prompt tokens included."""
    if compiled and cxx_compiler() is None:
        pytest.skip("no C++ compiler for Inductor")
    model = model_dir("llama")
    setup = dict(SETUPS[1], cpu_int4_activations="int8", compile_cpu_decode=compiled, deterministic=True)
    alone = make_llm(model, **setup)
    assert "int4 layers on int8 activations" in alone.engine.arithmetic
    assert (alone.engine.runner.compiled_decode is not None) is compiled
    for params in (GREEDY, SEEDED):
        expected = [_answer(alone.generate([p], params)[0]) for p in PROMPTS]
        together = _crowd(make_llm, model, params, **setup)
        differ = [i for i, out in enumerate(together) if out != expected[i % len(PROMPTS)]]
        assert differ == [], f"{len(differ)} of {len(together)} differ ({params.temperature=})"


@pytest.mark.slow
def test_a_sliding_window_model_in_a_crowd_answers_as_alone_in_the_mode(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    """Each token attends alone over the last ``window`` positions of its own context, so the window cuts every
    path the same way (its released blocks are never read)."""
    model = model_dir("mistral_sliding")
    alone = make_llm(model, deterministic=True, dtype="float32")
    for params in (GREEDY, SEEDED):
        expected = [_answer(alone.generate([p], params)[0]) for p in PROMPTS]
        together = _crowd(make_llm, model, params, deterministic=True, dtype="float32")
        differ = [i for i, out in enumerate(together) if out != expected[i % len(PROMPTS)]]
        assert differ == [], f"{len(differ)} of {len(together)} differ ({params.temperature=})"


def test_a_resumed_request_continues_exactly_as_the_clean_run(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    """A worker that dies after delivering some tokens re-runs prompt + delivered: the mode prefills the delivered
    tokens in one step as if they were decoded, and the seeded draws are keyed by position, so the rest is the
    clean run's."""
    llm = make_llm(model_dir("llama"), dtype="bfloat16", quantization="cpu-int4", deterministic=True)
    for params in (GREEDY, SEEDED):
        for prompt in PROMPTS[2:6]:
            clean, logprobs = _answer(llm.generate([prompt], params)[0])
            cut = len(clean) // 3
            rest = dataclasses.replace(params, max_tokens=len(clean) - cut)
            assert _answer(llm.generate([prompt + clean[:cut]], rest)[0]) == (clean[cut:], logprobs[cut:])


def test_the_mode_refuses_what_it_cannot_keep_invariant() -> None:
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(model="m", deterministic=True, speculative_config={"method": "draft_model", "model": "d"})
    with pytest.raises(ValueError, match="torch attention backend"):
        EngineConfig(model="m", deterministic=True, attention_backend="triton")
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        EngineConfig(model="m", deterministic="yes")  # type: ignore[arg-type]
