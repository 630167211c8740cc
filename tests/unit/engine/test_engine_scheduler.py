"""Scheduling policy: priority tiers, FIFO within a tier, preemption of lower tiers (by seat limit
and by KV pressure) with correct recomputation, and aborts of waiting and running requests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.llm_engine import LLMEngine

from .conftest import HFReference, random_prompts

PROMPTS = [p for p, _ in random_prompts(seed=11)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run_to_completion(engine: LLMEngine) -> list[str]:
    """Step until idle; return request ids in the order they finished."""
    order = []
    while engine.has_unfinished():
        order.extend(d.request_id for d in engine.step() if d.finished)
    return order


@pytest.fixture
def llama(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


def test_waiting_queue_orders_by_tier_then_arrival(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=1).engine
    engine.add_request(PROMPTS[2], _greedy(3), request_id="batch", priority=2)
    engine.add_request(PROMPTS[3], _greedy(3), request_id="std-1", priority=1)
    engine.add_request(PROMPTS[4], _greedy(3), request_id="interactive", priority=0)
    engine.add_request(PROMPTS[5], _greedy(3), request_id="std-2", priority=1)
    assert _run_to_completion(engine) == ["interactive", "std-1", "std-2", "batch"]


def test_interactive_arrival_preempts_batch_for_a_seat(
    llama: Path, make_llm: Callable[..., LLM], hf_reference: HFReference
) -> None:
    engine = make_llm(llama, max_num_seqs=1).engine
    engine.add_request(PROMPTS[8], _greedy(30), request_id="bulk", priority=2)
    finals = {}
    for _ in range(4):
        engine.step()
    engine.add_request(PROMPTS[6], _greedy(5), request_id="chat", priority=0)
    order = []
    while engine.has_unfinished():
        for d in engine.step():
            if d.final is not None:
                finals[d.request_id] = d.final
                order.append(d.request_id)
    assert order == ["chat", "bulk"]
    assert finals["bulk"].metrics.num_preemptions == 1
    # Recomputing prompt + already generated tokens continues exactly where it left off.
    assert finals["bulk"].token_ids == hf_reference.greedy(llama, PROMPTS[8], 30)
    assert finals["chat"].token_ids == hf_reference.greedy(llama, PROMPTS[6], 5)


def test_interactive_arrival_preempts_batch_under_kv_pressure(
    llama: Path, make_llm: Callable[..., LLM], hf_reference: HFReference
) -> None:
    # 34 blocks: the 300-token batch request holds ~19, the 256-token interactive one needs 17.
    engine = make_llm(llama, num_kv_blocks=34, enable_prefix_caching=False).engine
    engine.add_request(PROMPTS[15], _greedy(60), request_id="bulk", priority=2)
    for _ in range(3):
        engine.step()
    engine.add_request(PROMPTS[13], _greedy(10), request_id="chat", priority=0)
    finals = {}
    order = []
    while engine.has_unfinished():
        for d in engine.step():
            if d.final is not None:
                finals[d.request_id] = d.final
                order.append(d.request_id)
    assert order == ["chat", "bulk"]
    assert finals["bulk"].metrics.num_preemptions >= 1
    assert finals["chat"].metrics.num_preemptions == 0
    assert finals["bulk"].token_ids == hf_reference.greedy(llama, PROMPTS[15], 60)


def test_same_tier_arrival_does_not_preempt(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=1).engine
    engine.add_request(PROMPTS[8], _greedy(20), request_id="first")
    engine.step()
    engine.add_request(PROMPTS[6], _greedy(5), request_id="second")
    assert _run_to_completion(engine) == ["first", "second"]
    assert engine.scheduler.num_preemptions == 0


def test_abort_waiting_and_running_frees_blocks(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=2).engine
    total = engine.num_total_blocks
    for i in range(4):
        engine.add_request(PROMPTS[10 + i], _greedy(40), request_id=f"r{i}")
    for _ in range(3):
        engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {"r0", "r1"}
    assert engine.num_free_blocks < total
    running_delta = engine.abort_request("r0")
    waiting_delta = engine.abort_request("r3")
    assert running_delta is not None and running_delta.finished
    assert running_delta.finish_reason == "abort" and running_delta.final is not None
    assert running_delta.final.finish_reason == "abort"
    assert waiting_delta is not None and waiting_delta.final is not None
    assert waiting_delta.final.token_ids == []
    assert engine.abort_request("r0") is None
    assert engine.abort_request("nope") is None
    assert _run_to_completion(engine) == ["r1", "r2"]
    assert engine.num_free_blocks == total


def test_abort_everything_mid_generation(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_batched_tokens=64).engine
    ids = [engine.add_request(p, _greedy(50)) for p in PROMPTS]
    for _ in range(5):  # some requests mid-prefill (chunked), some decoding, some waiting
        engine.step()
    assert any(0 < s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running)
    for request_id in ids:
        engine.abort_request(request_id)
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.step() == []


def test_stats_count_running_and_waiting_per_priority(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=2).engine
    for i, priority in enumerate((2, 1, 1, 0, 2)):
        engine.add_request(PROMPTS[i], _greedy(20), request_id=f"r{i}", priority=priority)
    stats = engine.stats()
    assert stats.running_by_priority == {} and stats.waiting_by_priority == {0: 1, 1: 2, 2: 2}
    engine.step()  # two seats: the interactive request and the first standard one
    stats = engine.stats()
    assert stats.running_by_priority == {0: 1, 1: 1}
    assert stats.waiting_by_priority == {1: 1, 2: 2}
    assert sum(stats.running_by_priority.values()) == stats.num_running
    assert sum(stats.waiting_by_priority.values()) == stats.num_waiting
    engine.abort_request("r3")
    _run_to_completion(engine)
    stats = engine.stats()
    assert stats.running_by_priority == {} and stats.waiting_by_priority == {}
