"""Priority under load and per-tenant fairness in the scheduler: an interactive request that arrives while the
engine is saturated with batch work (seats taken, budget eaten by chunked prefills) is scheduled on the very
next step; inside a tier, tenants share admissions by weighted virtual time, so a tenant joining after another
tenant's flood is served at the next free seat; outputs stay exactly greedy and nothing leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, AsyncEngine, RequestStream, SamplingParams
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.llm_engine import LLMEngine

from .conftest import HFReference, random_prompts

PROMPTS = [p for p, _ in random_prompts(seed=31)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompt(length: int, salt: int) -> list[int]:
    return [3 + (i * 7 + salt * 13) % 500 for i in range(length)]


class Run:
    """What stepping an engine until idle showed: the step of each request's first token and of its
    finish, and its output tokens."""

    def __init__(self, engine: LLMEngine) -> None:
        self.first: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        step = 0
        while engine.has_unfinished():
            step += 1
            for delta in engine.step():
                self.first.setdefault(delta.request_id, step)
                if delta.final is not None:
                    self.done[delta.request_id] = step
                    self.tokens[delta.request_id] = delta.final.token_ids

    def finish_order(self) -> list[str]:
        return sorted(self.done, key=lambda rid: (self.done[rid], rid))


@pytest.fixture
def llama(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


def test_interactive_is_scheduled_on_the_next_step_despite_chunked_batch_prefills(
    llama: Path, make_llm: Callable[..., LLM], hf_reference: HFReference
) -> None:
    """The seat held by a batch request whose chunked 300-token prefill wants the whole token budget, more
    batch work queued: the interactive prefill still gets budget, and the seat by preemption, on the step
    right after it arrives (running prefills used to take the budget before any admission)."""
    engine = make_llm(llama, max_num_seqs=1, max_num_batched_tokens=64).engine
    batch_prompts = [_prompt(300, i) for i in range(3)]
    for i, prompt in enumerate(batch_prompts):
        engine.add_request(prompt, _greedy(12), request_id=f"bulk-{i}", priority=2)
    engine.step()
    [running] = engine.scheduler.running
    assert 0 < running.num_computed_tokens < running.num_tokens - 64
    engine.add_request(PROMPTS[4], _greedy(5), request_id="chat", priority=0)
    assert "chat" in {d.request_id for d in engine.step()}
    run = Run(engine)
    assert run.finish_order()[0] == "chat"
    assert run.tokens["chat"] == hf_reference.greedy(llama, PROMPTS[4], 5)
    for i, prompt in enumerate(batch_prompts):
        assert run.tokens[f"bulk-{i}"] == hf_reference.greedy(llama, prompt, 12)


def test_interactive_preempts_decoding_batch_for_a_seat_every_time(
    llama: Path, make_llm: Callable[..., LLM], hf_reference: HFReference
) -> None:
    """Seats full of decoding batch sequences: each interactive arrival produces a token on the next step;
    the preempted batch sequences are recomputed and end with exactly the greedy tokens."""
    engine = make_llm(llama, max_num_seqs=3).engine
    for i in range(6):
        engine.add_request(PROMPTS[i], _greedy(40), request_id=f"bulk-{i}", priority=2)
    for _ in range(3):
        engine.step()
    for k in range(3):
        engine.add_request(PROMPTS[8 + k], _greedy(4), request_id=f"chat-{k}", priority=0)
        produced = {d.request_id for d in engine.step()}
        assert f"chat-{k}" in produced, f"chat-{k} waited a step: {produced}"
        for _ in range(5):
            engine.step()
    run = Run(engine)
    assert engine.scheduler.num_preemptions >= 3
    for i in range(6):
        assert run.tokens[f"bulk-{i}"] == hf_reference.greedy(llama, PROMPTS[i], 40)


def test_a_tenant_joining_after_a_flood_gets_the_next_free_seats(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=2).engine
    for i in range(12):
        engine.add_request(_prompt(20, i), _greedy(8), request_id=f"A{i}", tenant="tenant-a")
    engine.step()
    engine.step()
    engine.add_request(_prompt(20, 100), _greedy(8), request_id="B0", tenant="tenant-b")
    engine.add_request(_prompt(20, 101), _greedy(8), request_id="B1", tenant="tenant-b")
    run = Run(engine)
    first, done = run.first, run.done
    # First-come-first-served would start B0 after all twelve A requests. Here B0 takes the first free
    # seat; its prompt tokens then put tenant-b ahead in virtual time, so A2 and B1 alternate with it.
    assert first["B0"] <= first["A2"]
    assert first["B1"] <= first["A3"]
    assert max(done["B0"], done["B1"]) < first["A4"]
    assert run.finish_order()[-1].startswith("A")
    assert engine.scheduler.tenants == {}


def test_weights_divide_a_tier_between_backlogged_tenants(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=4, tenant_weights={"gold": 3.0}).engine
    for i in range(16):
        engine.add_request(_prompt(20, i), _greedy(10), request_id=f"silver-{i}", tenant="silver")
        engine.add_request(_prompt(20, 50 + i), _greedy(10), request_id=f"gold-{i}", tenant="gold")
    order = Run(engine).finish_order()
    # While both are backlogged, gold (weight 3) gets about three of every four seats.
    gold_share = sum(rid.startswith("gold") for rid in order[:16])
    assert 11 <= gold_share <= 13, order


def test_tiers_still_come_before_tenant_shares(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=1).engine
    engine.add_request(PROMPTS[1], _greedy(3), request_id="a-batch", tenant="a", priority=2)
    engine.add_request(PROMPTS[2], _greedy(3), request_id="a-std", tenant="a", priority=1)
    engine.add_request(PROMPTS[3], _greedy(3), request_id="b-std", tenant="b", priority=1)
    engine.add_request(PROMPTS[4], _greedy(3), request_id="b-chat", tenant="b", priority=0)
    assert Run(engine).finish_order() == ["b-chat", "a-std", "b-std", "a-batch"]


def test_a_joining_tenant_starts_at_the_smallest_live_virtual_time(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=4).engine
    tenants = engine.scheduler.tenants
    engine.add_request(PROMPTS[5], _greedy(30), tenant="a")
    engine.add_request(PROMPTS[6], _greedy(30), tenant="b")
    engine.add_request(PROMPTS[7], _greedy(30), tenant="b")
    for _ in range(4):
        engine.step()
    assert 0 < tenants["a"].vtime < tenants["b"].vtime
    engine.add_request(PROMPTS[8], _greedy(3), tenant="c")
    # No credit for the time it was away: it starts level with the least-served live tenant.
    assert tenants["c"].vtime == tenants["a"].vtime
    Run(engine)
    assert tenants == {}


def test_tenant_state_is_released_by_aborts(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama, max_num_seqs=2).engine
    ids = [engine.add_request(PROMPTS[i], _greedy(20), tenant=f"t{i % 3}") for i in range(6)]
    engine.step()
    assert set(engine.scheduler.tenants) == {"t0", "t1", "t2"}
    for request_id in ids:
        engine.abort_request(request_id)
    assert engine.scheduler.tenants == {}
    assert engine.num_free_blocks == engine.num_total_blocks


async def test_async_engine_passes_the_tenant_through(llama: Path, make_llm: Callable[..., LLM]) -> None:
    """One seat held by tenant a; a's three queued requests and then b's one: b's goes next."""
    llm = make_llm(llama, max_num_seqs=1)
    finished: list[str] = []

    async def drain(stream: RequestStream) -> None:
        async for delta in stream:
            if delta.finished:
                finished.append(delta.request_id)

    async with AsyncEngine(engine=llm.engine) as engine:
        streams = [engine.add_request(PROMPTS[9], _greedy(20), request_id="hog", tenant="a")]
        streams += [engine.add_request(PROMPTS[10], _greedy(2), request_id=f"a{i}", tenant="a") for i in range(3)]
        streams.append(engine.add_request(PROMPTS[11], _greedy(2), request_id="b0", tenant="b"))
        await asyncio.gather(*(drain(stream) for stream in streams))
    assert finished == ["hog", "b0", "a0", "a1", "a2"]


def test_bad_tenants_and_weights_are_clear_errors(llama: Path, make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(llama).engine
    for bad in ("", None, 7):
        with pytest.raises(ValueError, match="tenant must be a non-empty string"):
            engine.add_request(PROMPTS[0], _greedy(2), tenant=bad)  # type: ignore[arg-type]
    for weights, message in (
        ({"a": 0}, "positive finite"),
        ({"a": float("inf")}, "positive finite"),
        ({"a": True}, "positive finite"),
        ({"": 1.0}, "non-empty strings"),
        ([("a", 1.0)], "must be a dict"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=str(llama), tenant_weights=weights)  # type: ignore[arg-type]
