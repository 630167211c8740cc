"""A re-delivered request with several choices (``n`` = 3) on the worker in-process against real Kafka and
Redis: each choice continues from the tokens its stream holds (one that had ended stays ended, one whose
tokens already end it just ends), with text that joins seamlessly, and no engine request or KV block is left
behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio import Redis
from test_worker import (  # noqa: F401  (module fixtures: model_dir, engine; the in-process worker helpers)
    engine,
    model_dir,
    publish,
    reference_run,
    request_for,
    running_worker,
    wait_idle_heartbeat,
    wait_terminal,
)

from gpu_workers.engine import AsyncEngine, SamplingParams
from gpu_workers.worker.streams import StreamPublisher
from schemas import DoneEvent, Names, RestartEvent, TokenEvent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MAX_TOKENS = 40


async def test_each_choice_continues_from_its_own_delivered_tokens(
    kafka_bootstrap: str,
    redis_url: str,
    redis: Redis,
    model_dir: Path,  # noqa: F811
    engine: AsyncEngine,  # noqa: F811
    unique_prefix: str,
) -> None:
    request = request_for(MAX_TOKENS)
    request = request.model_copy(update={"sampling": request.sampling.model_copy(update={"n": 3})})
    rid = request.request_id
    prompt_ids = list(engine.tokenizer.encode(request.prompt))
    # Greedy: every choice of an uninterrupted run is this one.
    ref = await reference_run(
        engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    # What a crashed worker left, interleaved as choices stream: choice 0 cut after 17 deltas, choice 1
    # ended (its last event says so), choice 2 has every token but not its end.
    cut = {0: 17, 1: len(ref.deltas), 2: len(ref.deltas)}
    publisher = StreamPublisher(redis, Names(unique_prefix), ttl_s=600)
    seq = 0
    for step, (text, ids) in enumerate(ref.deltas):
        for index in range(3):
            if step < cut[index]:
                reason = "length" if index == 1 and step == len(ref.deltas) - 1 else None
                event = TokenEvent(request_id=rid, seq=seq, text=text, token_ids=ids, index=index, finish_reason=reason)
                publisher.add(event)
                seq += 1
    await publisher.flush()
    delivered = seq

    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix) as worker:
        await publish(worker, request)
        events = await wait_terminal(worker.redis, worker.names, rid)
        assert [e.seq for e in events] == list(range(len(events)))
        assert not any(isinstance(e, RestartEvent) for e in events), "continued, not started over"
        done = events[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "length"
        assert done.usage.completion_tokens == 3 * MAX_TOKENS
        new = [e for e in events[delivered:] if isinstance(e, TokenEvent)]
        assert {e.index for e in new} == {0, 2}, "choice 1 had ended: nothing more for it"
        assert [(e.text, e.token_ids, e.finish_reason) for e in new if e.index == 2] == [("", [], "length")]
        for index in range(3):
            mine = [e for e in events if isinstance(e, TokenEvent) and e.index == index]
            assert [t for e in mine for t in e.token_ids] == ref.token_ids
            assert "".join(e.text for e in mine) == ref.text
            assert mine[-1].finish_reason == "length"
        # The per-choice engine requests were all let go: nothing running, every KV block free.
        await wait_idle_heartbeat(worker.redis, worker.names)
