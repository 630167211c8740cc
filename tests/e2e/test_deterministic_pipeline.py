"""The deterministic mode through the real pipeline, as ``up`` serves on the CPU (bfloat16 with the weights kept
4-bit, ``cpu-int4``, on int8 activations where that kernel runs, the W8A8 LM head, steps compiled), two workers:

- ``kill -9`` of the worker generating a greedy and a seeded sampled request: the next owner re-runs prompt +
  delivered tokens, and both requests end with exactly the tokens of a clean run (the mode prefills the delivered
  tokens as if decoded, and seeded draws are keyed by position, not by the worker's generator);
- prompts sent one at a time, then all of them twice at once (batched together, spread over both workers, the
  second copy served from the prefix cache): every reply equals the lone one, greedy and seeded.

The reference is the same engine in this process, one thread like the workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_workers.engine import LLM, SamplingParams
from schemas import RestartEvent, TokenEvent

from .conftest import Pipeline
from .test_recovery import PROMPT, ensure_workers, tiny_model_dir, wait_owner

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]
__all__ = ["tiny_model_dir"]  # the paced model, shared with test_recovery

MAX_TOKENS = 200
# ``up``'s default on a CPU with bfloat16 instructions (cli/stack/launcher.py), with the mode on.
PRECISION = {
    "dtype": "bfloat16",
    "quantization": "cpu-int4",
    "lm_head_quantization": "w8a8",
    "cpu_int4_activations": "auto",  # the workers' default; the engine's own is bfloat16
}
SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
CROWD_PROMPTS = [f"Item {i}: the {word} of the river" for i, word in enumerate("abcdefghijkl")]
CROWD_TOKENS = 24


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",  # the workers' thread count, as the reference's below: one reduction order
        "SLUICEGATE_DETERMINISTIC": "true",
        "SLUICEGATE_DTYPE": PRECISION["dtype"],
        "SLUICEGATE_QUANTIZATION": PRECISION["quantization"],
        "SLUICEGATE_LM_HEAD_QUANTIZATION": PRECISION["lm_head_quantization"],
        "SLUICEGATE_CPU_INT4_ACTIVATIONS": PRECISION["cpu_int4_activations"],
        "SLUICEGATE_COMPILE_CPU_DECODE": "true",
    }


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(model=str(tiny_model_dir), device="cpu", deterministic=True, compile_cpu_decode=True, **PRECISION)
    finally:
        torch.set_num_threads(threads)


def _clean(llm: LLM, prompt: str, max_tokens: int, **params: Any) -> list[int]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **params})
    return llm.generate([prompt], sampling)[0].token_ids


def _tokens(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def _finished_tokens(pipeline: Pipeline, request_id: str, timeout_s: float = 120) -> list[int]:
    events = pipeline.wait_stream_end(request_id, timeout_s=timeout_s)
    assert events[-1].type == "done", events[-1]
    assert not any(isinstance(e, RestartEvent) for e in events), "continued, not started over"
    assert [e.seq for e in events] == list(range(len(events))), "gap or duplicate"
    return _tokens(events)


def test_the_pipeline_reports_the_mode(pipeline: Pipeline) -> None:
    ensure_workers(pipeline)
    beats = pipeline.heartbeats().values()
    assert all(beat.deterministic for beat in beats)
    # Both say how they compute, alike, so /v1/models has nothing to warn of.
    assert len({beat.arithmetic for beat in beats}) == 1, [beat.arithmetic for beat in beats]
    assert all((beat.arithmetic or "").startswith("cpu compiled steps, 1 threads, ") for beat in beats)
    for service in pipeline.services:
        if service.name.startswith("worker"):  # the mode's steps compiled, as `up` runs them, not the eager fallback
            assert "steps compiled for the CPU" in service.log_path.read_text(errors="replace"), service.name


@pytest.mark.parametrize("params", [{"temperature": 0}, SEEDED], ids=["greedy", "seeded"])
def test_a_request_ends_as_a_clean_run_after_its_worker_is_killed(
    pipeline: Pipeline, llm: LLM, params: dict[str, Any]
) -> None:
    ensure_workers(pipeline)
    rid = pipeline.submit(prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **params)["request_id"]
    owner = wait_owner(pipeline, rid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_tokens(pipeline.stream_events(rid))) < 20:
        time.sleep(0.01)
    pipeline.kill(pipeline.find(owner))
    delivered = len(_tokens(pipeline.stream_events(rid)))
    assert 20 <= delivered < MAX_TOKENS - 30, f"not killed mid-generation: {delivered} delivered"

    tokens = _finished_tokens(pipeline, rid)
    assert pipeline.record(rid).worker_id != owner
    clean = _clean(llm, PROMPT, MAX_TOKENS, **params)
    assert len(tokens) == len(clean) == MAX_TOKENS
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, clean, strict=True)) if a != b), None)
    assert first_diff is None, f"differs from the clean run at token {first_diff} ({delivered} delivered)"
    print(f"FAULT-REPORT deterministic kill -9 {params}: {delivered} of {MAX_TOKENS} delivered, 0 tokens differ")


def test_prompts_alone_equal_the_same_prompts_all_at_once(pipeline: Pipeline, llm: LLM) -> None:
    ensure_workers(pipeline)
    for params in ({"temperature": 0}, SEEDED):
        alone = []
        for prompt in CROWD_PROMPTS:
            rid = pipeline.submit(prompt=prompt, max_tokens=CROWD_TOKENS, ignore_eos=True, **params)["request_id"]
            alone.append(_finished_tokens(pipeline, rid))
        crowd = [
            pipeline.submit(prompt=prompt, max_tokens=CROWD_TOKENS, ignore_eos=True, **params)["request_id"]
            for prompt in CROWD_PROMPTS + CROWD_PROMPTS
        ]
        together = [_finished_tokens(pipeline, rid) for rid in crowd]
        workers = {pipeline.record(rid).worker_id for rid in crowd}
        differ = [i for i, tokens in enumerate(together) if tokens != alone[i % len(CROWD_PROMPTS)]]
        assert differ == [], f"{len(differ)} of {len(together)} differ ({params})"
        # And the workers answer as the reference engine does, so either of them could have served any of them.
        assert alone[0] == _clean(llm, CROWD_PROMPTS[0], CROWD_TOKENS, **params)
        print(f"FAULT-REPORT deterministic crowd {params}: 0 of {len(together)} differ, served by {sorted(workers)}")
