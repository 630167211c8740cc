"""Compiled CPU decode steps (execution/cpu_decode_compile.py): the same greedy tokens as transformers in float32,
one row and many, prompts across block boundaries; what it refuses, by name; eager when it cannot compile."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from needs import needs

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.execution import cpu_decode_compile
from gpu_workers.engine.execution.cpu_decode_compile import CompiledCpuDecode, cxx_compiler

from .conftest import HFReference, random_prompts

needs_compiler = needs(cxx_compiler() is not None, "a C++ compiler for Inductor", "apt-get install g++")


def assert_serves_eagerly(llm: LLM) -> None:
    assert llm.engine.runner.compiled_decode is None
    assert llm.engine.arithmetic.startswith("cpu eager steps, ")  # what the heartbeat tells the fleet
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


class CountingRuns:
    """Counts the decode steps that went through the compiled graph."""

    def __init__(self, compiled: CompiledCpuDecode) -> None:
        self.rows: list[int] = []
        inner = compiled.run

        def run(prepared: Any) -> Any:
            self.rows.append(int(prepared.input_ids.shape[0]))
            return inner(prepared)

        compiled.run = run  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def compiled_llm(model_dir: Callable[[str], Path]) -> LLM:
    # One engine for the module: compiling the two graphs is the slow part (seconds once Inductor's cache is warm).
    return LLM(str(model_dir("llama3_tied")), dtype="float32", max_model_len=512, compile_cpu_decode=True)


@pytest.mark.slow
@needs_compiler
def test_compiled_decode_gives_transformers_tokens_alone_and_batched(
    compiled_llm: LLM, model_dir: Callable[[str], Path], hf_reference: HFReference
) -> None:
    compiled = compiled_llm.engine.runner.compiled_decode
    assert compiled is not None, "the tiny Llama should compile on the CPU"
    counter = CountingRuns(compiled)
    path = model_dir("llama3_tied")
    # Lengths 1..300 straddle the 16-token blocks, so block tables grow while the batch decodes.
    cases = random_prompts(seed=11)[::3]
    expected = [hf_reference.greedy(path, prompt, n) for prompt, n in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in cases]
    together = compiled_llm.generate([p for p, _ in cases], params)
    assert [out.token_ids for out in together] == expected
    alone = compiled_llm.generate([cases[0][0]], params[0])
    assert alone[0].token_ids == expected[0]
    assert 1 in counter.rows and max(counter.rows) > 1, counter.rows


@pytest.mark.slow
@needs_compiler
def test_in_the_deterministic_mode_every_step_is_compiled_and_gives_transformers_tokens(
    compiled_llm: LLM, make_llm: Callable[..., LLM], model_dir: Callable[[str], Path], hf_reference: HFReference
) -> None:
    """Prompt tokens too go through the graph, as rows of their own; and this engine, the second compiled one in
    the process (``compiled_llm`` is the first, with another cache), gets its own graph, not the first one's."""
    assert compiled_llm.engine.runner.compiled_decode is not None
    path = model_dir("llama3_tied")
    llm = make_llm(path, dtype="float32", compile_cpu_decode=True, deterministic=True, num_kv_blocks=96)
    compiled = llm.engine.runner.compiled_decode
    assert compiled is not None and compiled.invariant
    assert llm.engine.arithmetic.startswith("cpu compiled steps, ")
    steps: list[int] = []
    run_step = compiled.run_step

    def counting(input_ids: Any, positions: Any, meta: Any) -> Any:
        steps.append(int(input_ids.shape[0]))
        return run_step(input_ids, positions, meta)

    compiled.run_step = counting  # type: ignore[method-assign]
    cases = random_prompts(seed=11)[1::4]
    expected = [hf_reference.greedy(path, prompt, n) for prompt, n in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in cases]
    assert [out.token_ids for out in llm.generate([p for p, _ in cases], params)] == expected
    assert max(steps) > cpu_decode_compile.MAX_ROWS, "a step longer than the graph's rows runs in pieces"


@pytest.mark.slow
@needs_compiler
def test_short_prompt_steps_run_as_token_rows_and_give_transformers_tokens(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path], hf_reference: HFReference
) -> None:
    """Prefill chunks and mixed steps of up to ``ROWS_MAX_TOKENS`` tokens over contexts up to ``ROWS_MAX_CONTEXT``
    go through the graph, every token a row (prefix hits, chunks of 16, decode rows beside them, a lone token); a
    longer context's chunks stay eager. Greedy tokens equal transformers' either way."""
    path = model_dir("llama3_tied")
    llm = make_llm(path, dtype="float32", compile_cpu_decode=True, max_num_batched_tokens=16, num_kv_blocks=96)
    runner = llm.engine.runner
    compiled = runner.compiled_decode
    assert compiled is not None and not compiled.invariant
    as_rows: list[tuple[int, int]] = []
    run_step = compiled.run_step

    def counting(input_ids: Any, positions: Any, meta: Any) -> Any:
        as_rows.append((int(input_ids.shape[0]), int(meta.max_seq_len)))
        return run_step(input_ids, positions, meta)

    compiled.run_step = counting  # type: ignore[method-assign]
    eager: list[int] = []
    model = runner.model

    def eager_forward(input_ids: Any, positions: Any, meta: Any) -> Any:
        eager.append(int(meta.max_seq_len))
        return model(input_ids, positions, meta)

    runner.model = eager_forward  # the graphs hold the model itself: only eager steps call this
    runner.model.compute_logits = model.compute_logits  # type: ignore[attr-defined]
    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(40)]
    cases = [(system + [rng.randrange(3, 512) for _ in range(n)], m) for n, m in ((5, 12), (23, 7), (1, 20), (60, 3))]
    cases.append(([rng.randrange(3, 512) for _ in range(300)], 4))  # past ROWS_MAX_CONTEXT from its 17th chunk
    expected = [hf_reference.greedy(path, prompt, n) for prompt, n in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in cases]
    assert [out.token_ids for out in llm.generate([p for p, _ in cases], params)] == expected
    again = llm.generate([cases[2][0]], params[2])  # its 40 + 1 tokens: 32 from the cache, 9 as rows
    assert again[0].token_ids == expected[2]
    assert as_rows and max(tokens for tokens, _ in as_rows) <= 16
    assert max(context for _, context in as_rows) <= cpu_decode_compile.ROWS_MAX_CONTEXT
    assert eager and min(eager) > cpu_decode_compile.ROWS_MAX_CONTEXT, "only the long context's chunks run eagerly"


@needs_compiler
def test_what_the_compiled_path_refuses_is_named(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=cpu_decode_compile.__name__)
    sliding = make_llm(model_dir("mistral_sliding"), dtype="float32", compile_cpu_decode=True)
    assert sliding.engine.runner.compiled_decode is None
    fp8 = make_llm(model_dir("llama"), dtype="float32", compile_cpu_decode=True, kv_cache_dtype="fp8")
    assert fp8.engine.runner.compiled_decode is None
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled CPU decode off")]
    assert any("sliding-window" in r for r in reasons), reasons
    assert any("FP8" in r for r in reasons), reasons
    off = make_llm(model_dir("llama"), dtype="float32")
    assert off.engine.runner.compiled_decode is None


def test_without_a_compiler_the_engine_stays_eager(
    make_llm: Callable[..., LLM],
    model_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    caplog.set_level(logging.INFO, logger=cpu_decode_compile.__name__)
    llm = make_llm(model_dir("llama"), dtype="float32", compile_cpu_decode=True)
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    assert_serves_eagerly(llm)


@needs_compiler
def test_a_failed_compile_leaves_the_eager_path(
    make_llm: Callable[..., LLM],
    model_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(self: CompiledCpuDecode, runner: Any) -> None:
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(CompiledCpuDecode, "warm_up", broken)
    llm = make_llm(model_dir("llama"), dtype="float32", compile_cpu_decode=True)
    assert any("compiler exploded" in r.getMessage() for r in caplog.records)
    assert_serves_eagerly(llm)
