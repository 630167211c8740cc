"""The lower tiers' share of a step: while a more important tier has work (running or waiting), the less important
tiers together get at most ``lower_tier_max_batched_tokens`` tokens of each step, decodes and prefill chunks alike;
once it has none they get the whole budget again. Greedy outputs are unchanged by the cap."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_workers.engine import SamplingParams
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.llm_engine import LLMEngine

from .conftest import MAX_MODEL_LEN, HFReference, random_prompts

PROMPTS = [p for p, _ in random_prompts(seed=47)]
CAP = 4


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class Steps:
    """Each step's scheduled work as (priority, tokens) pairs, read from the engine's own scheduler."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[list[tuple[int, int]]] = []
        schedule = engine.scheduler.schedule

        def recording():  # type: ignore[no-untyped-def]
            batch = schedule()
            self.steps.append([(s.priority, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)])
            return batch

        engine.scheduler.schedule = recording  # type: ignore[method-assign]

    def tokens_below(self, step: int, tier: int) -> int:
        return sum(n for priority, n in self.steps[step] if priority > tier)

    def has(self, step: int, tier: int) -> bool:
        return any(priority == tier for priority, _ in self.steps[step])


@pytest.fixture
def llama(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


@pytest.fixture
def make_engine(llama: Path) -> Iterator[Callable[..., LLMEngine]]:
    """Engines on the tiny llama (the knob is an ``EngineConfig`` field, as the worker passes it); after the
    test every one of them must be idle with its KV pool whole."""
    created: list[LLMEngine] = []

    def factory(**kwargs: Any) -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=str(llama), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, **kwargs))
        created.append(engine)
        return engine

    yield factory
    for engine in created:
        assert not engine.has_unfinished()
        assert engine.num_free_blocks == engine.num_total_blocks


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.final is not None:
                finals[delta.request_id] = delta.final.token_ids
    return finals


def test_lower_tiers_are_capped_while_a_higher_tier_has_work_and_uncapped_after(
    llama: Path, make_engine: Callable[..., LLMEngine], hf_reference: HFReference
) -> None:
    engine = make_engine(max_num_seqs=16, lower_tier_max_batched_tokens=CAP)
    steps = Steps(engine)
    for i in range(8):
        engine.add_request(PROMPTS[i], _greedy(24), request_id=f"bulk-{i}", priority=2)
    engine.step()
    engine.step()
    # Alone, the batch tier is the most important one with work: the whole budget (8 decodes here).
    assert steps.tokens_below(1, 1) == 8
    engine.add_request(PROMPTS[10], _greedy(6), request_id="chat", priority=0)
    finals: dict[str, list[int]] = {}
    while "chat" not in finals:
        step = len(steps.steps)
        for delta in engine.step():
            if delta.final is not None:
                finals[delta.request_id] = delta.final.token_ids
        assert steps.has(step, 0), "the interactive request missed a step"
        assert 0 < steps.tokens_below(step, 0) <= CAP, steps.steps[step]
    engine.step()
    assert steps.tokens_below(len(steps.steps) - 1, 1) == 8, "the cap outlived the interactive request"
    finals.update(_run(engine))
    assert finals["chat"] == hf_reference.greedy(llama, PROMPTS[10], 6)
    for i in range(8):
        assert finals[f"bulk-{i}"] == hf_reference.greedy(llama, PROMPTS[i], 24)


def test_a_waiting_higher_tier_caps_lower_prefill_chunks(
    llama: Path, make_engine: Callable[..., LLMEngine], hf_reference: HFReference
) -> None:
    """A standard request waiting for a seat (held by a batch one) still makes the batch tier's prompts go in
    chunks of at most the cap, and it is the most important tier then, so it is not capped itself."""
    engine = make_engine(max_num_seqs=4, lower_tier_max_batched_tokens=CAP)
    steps = Steps(engine)
    engine.add_request(PROMPTS[1], _greedy(8), request_id="std", priority=1)
    for i in range(3):
        engine.add_request(PROMPTS[2 + i], _greedy(8), request_id=f"bulk-{i}", priority=2)
    engine.step()
    assert sum(n for priority, n in steps.steps[0] if priority == 1) == len(PROMPTS[1])
    assert 0 < steps.tokens_below(0, 1) <= CAP
    finals = _run(engine)
    assert all(steps.tokens_below(s, 1) <= CAP for s in range(len(steps.steps)) if steps.has(s, 1))
    assert finals["std"] == hf_reference.greedy(llama, PROMPTS[1], 8)
    for i in range(3):
        assert finals[f"bulk-{i}"] == hf_reference.greedy(llama, PROMPTS[2 + i], 8)


def test_without_a_cap_lower_tiers_share_the_whole_budget(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_num_seqs=16)
    steps = Steps(engine)
    for i in range(8):
        engine.add_request(PROMPTS[i], _greedy(6), request_id=f"bulk-{i}", priority=2)
    engine.step()
    engine.add_request(PROMPTS[10], _greedy(6), request_id="chat", priority=0)
    engine.step()
    assert steps.has(1, 0) and steps.tokens_below(1, 0) == 8
    _run(engine)


def test_the_cap_must_be_positive(llama: Path) -> None:
    with pytest.raises(ValueError, match="lower_tier_max_batched_tokens"):
        EngineConfig(model=str(llama), lower_tier_max_batched_tokens=0)
