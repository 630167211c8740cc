"""``stream_interval_ms``: a request's first token and its end go out at once, the tokens in between wait for the
interval and then ride in one delta; joined, the deltas are exactly what a delta every step gives."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpu_workers.engine import LLM, RequestDelta, SamplingParams, llm_engine
from gpu_workers.engine.config import EngineConfig

PROMPT = [5, 17, 99, 17, 250, 3, 41, 41, 300, 7]


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)


def _run(
    llm: LLM,
    n: int,
    pause_s: Callable[[int], float] = lambda _: 0.0,
    sleep: Callable[[float], None] = time.sleep,
) -> list[tuple[int, RequestDelta]]:
    """(step number, delta) of one request stepped to its end, sleeping ``pause_s(step)`` before each step."""
    engine = llm.engine
    engine.add_request(PROMPT, _params(n), request_id="r")
    out: list[tuple[int, RequestDelta]] = []
    step = 0
    while engine.has_unfinished():
        sleep(pause_s(step))
        out += [(step, d) for d in engine.step()]
        step += 1
    return out


def _joined(deltas: list[RequestDelta]) -> tuple[list[int], str, list[int]]:
    tokens = [t for d in deltas for t in d.token_ids]
    logprob_ids = [lp.token_id for d in deltas for lp in d.logprobs or []]
    return tokens, "".join(d.text for d in deltas), logprob_ids


def test_a_long_interval_sends_the_first_token_and_the_rest_with_the_end(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    every_step = [d for _, d in _run(make_llm(model_dir("llama")), 12)]
    assert [len(d.token_ids) for d in every_step] == [1] * 12

    held = [d for _, d in _run(make_llm(model_dir("llama"), stream_interval_ms=60_000), 12)]
    assert [len(d.token_ids) for d in held] == [1, 11]
    assert [d.finished for d in held] == [False, True]
    assert _joined(held) == _joined(every_step)
    assert _joined(held)[2] == _joined(held)[0]  # logprobs stay aligned with their tokens


class SteppedClock:
    """The engine's ``time`` module with a wall clock that moves only when the test moves it: steps take no time,
    so the test does not depend on how fast a busy machine runs them."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_delta_goes_out_once_the_interval_has_passed(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(model_dir("llama"), stream_interval_ms=40)
    clock = SteppedClock()
    monkeypatch.setattr(llm_engine, "time", clock)
    # Steps 0 (prefill: the first token) and 1-3 run back to back; step 4 comes after a pause longer than the
    # interval, so its delta carries the tokens of steps 1-4; steps 5-8 run at once again and end the request.
    deltas = _run(llm, 9, pause_s=lambda step: 0.06 if step == 4 else 0.0, sleep=clock.sleep)
    assert [(step, len(d.token_ids)) for step, d in deltas] == [(0, 1), (4, 4), (8, 4)]
    assert deltas[-1][1].finished


def test_an_abort_hands_out_what_was_held(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(model_dir("llama"), stream_interval_ms=60_000).engine
    engine.add_request(PROMPT, _params(20), request_id="r")
    seen = [d for _ in range(5) for d in engine.step()]
    final = engine.abort("r")
    assert [len(d.token_ids) for d in seen] == [1]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "abort"
    assert len(final[0].token_ids) == 4


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_non_finite_interval_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="stream_interval_ms"):
        EngineConfig(model="unused", stream_interval_ms=bad)
