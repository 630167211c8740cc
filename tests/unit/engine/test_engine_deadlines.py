"""Earliest-deadline-first inside a tier: waiting requests that carry a deadline start in deadline order, ahead
of those without one (which keep their arrival / tenant-fair order), and never ahead of a more important tier."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.core.request import EngineRequest
from gpu_workers.engine.llm_engine import LLMEngine

from .conftest import HFReference


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompt(length: int, salt: int) -> list[int]:
    return [3 + (i * 7 + salt * 13) % 500 for i in range(length)]


def _start_order(engine: LLMEngine) -> tuple[list[str], dict[str, list[int]]]:
    """Step until idle; the request ids in the order of their first token, and each one's output."""
    started: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id not in started:
                started.append(delta.request_id)
            if delta.final is not None:
                tokens[delta.request_id] = delta.final.token_ids
    return started, tokens


@pytest.fixture
def llama(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


def test_waiting_requests_with_deadlines_start_earliest_first_before_those_without(
    llama: Path, make_llm: Callable[..., LLM], hf_reference: HFReference
) -> None:
    """The engine is full (one seat, taken); requests with deadlines arrive in shuffled order among requests
    without one: once the seat frees, the ones with deadlines start in deadline order, then the rest by arrival;
    outputs stay exactly greedy."""
    engine = make_llm(llama, max_num_seqs=1).engine
    engine.add_request(_prompt(20, 0), _greedy(4), request_id="holder")
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["holder"]
    now = time.time()
    with_deadline = [f"d{i}" for i in range(6)]
    arrivals = [*with_deadline, "plain-0", "plain-1", "plain-2"]
    random.Random(7).shuffle(arrivals)
    prompts = {rid: _prompt(9 + n, n + 1) for n, rid in enumerate(arrivals)}
    for rid in arrivals:
        deadline = now + 10 + int(rid[1:]) if rid.startswith("d") else None
        engine.submit(EngineRequest.build(prompts[rid], _greedy(3), request_id=rid, deadline=deadline))
    started, tokens = _start_order(engine)
    plain_in_arrival_order = [rid for rid in arrivals if rid.startswith("plain")]
    assert started == ["holder", *with_deadline, *plain_in_arrival_order]
    for rid in arrivals:
        assert tokens[rid] == hf_reference.greedy(llama, prompts[rid], 3)


def test_deadlines_order_only_inside_a_tier_and_ahead_of_tenant_fairness(
    llama: Path, make_llm: Callable[..., LLM]
) -> None:
    """A more important tier still starts first, whatever the deadlines below it; inside a tier with several
    tenants, a request with a deadline goes ahead of the tenant-fair order of those without."""
    engine = make_llm(llama, max_num_seqs=1).engine
    engine.add_request(_prompt(20, 0), _greedy(4), request_id="holder", priority=1)
    engine.step()
    now = time.time()
    engine.add_request(_prompt(10, 1), _greedy(2), request_id="a-plain", priority=1, tenant="a")
    engine.add_request(_prompt(10, 2), _greedy(2), request_id="b-plain", priority=1, tenant="b")
    engine.add_request(_prompt(10, 3), _greedy(2), request_id="b-late", priority=1, tenant="b", deadline=now + 60)
    engine.add_request(_prompt(10, 4), _greedy(2), request_id="a-soon", priority=1, tenant="a", deadline=now + 5)
    engine.add_request(_prompt(10, 5), _greedy(2), request_id="urgent", priority=0, tenant="c")
    started, _ = _start_order(engine)
    # "urgent" takes the seat by preempting "holder", which waits again without a deadline.
    assert started[:3] == ["urgent", "a-soon", "b-late"]
    assert set(started[3:]) == {"holder", "a-plain", "b-plain"}


def test_a_bad_deadline_is_refused_on_construction() -> None:
    with pytest.raises(ValueError, match="deadline"):
        EngineRequest.build([5, 6], deadline="soon")  # type: ignore[arg-type]
