"""Fewer Redis messages per request, same stream: the worker's stream interval (tokens made between two deltas share
one event) and pickup reads that take the publisher's buffered writes along, on real Kafka and Redis."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from test_worker import (  # noqa: F401  (module fixtures: model_dir, engine)
    engine,
    model_dir,
    publish,
    reference_run,
    request_for,
    running_worker,
    wait_terminal,
)

from gpu_workers.engine import AsyncEngine, SamplingParams
from gpu_workers.worker.stream_state import read_pickup_state
from gpu_workers.worker.streams import RecordWrite, StreamPublisher
from schemas import Names, TokenEvent


async def test_pickup_reads_carry_the_buffered_writes_in_one_round_trip(redis_url: str, unique_prefix: str) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    other, picked = uuid.uuid4().hex, uuid.uuid4().hex
    batches: list[list[Any]] = []
    publisher = StreamPublisher(redis, names, ttl_s=600, on_send=lambda batch: batches.append(list(batch)))
    try:
        await redis.set(names.request_key(picked), b'{"status": "queued"}')
        await redis.set(names.cancel_key(picked), b"1")
        publisher.add(TokenEvent(request_id=picked, seq=0, text="a", token_ids=[7]))
        publisher.add(RecordWrite(names.request_key(other), "finished", 60, other))
        state = await read_pickup_state(publisher, names, picked)
        # The reads come after the writes of the same pipeline: they see the append made with them.
        assert state.stream.token_ids == [7] and state.stream.next_seq == 1
        assert state.cancel_marked and state.record == b'{"status": "queued"}'
        assert len(batches) == 1 and publisher.pending == 0
        assert await redis.get(names.request_key(other)) == b"finished"
        # Nothing buffered: the reads go alone, and nothing is reported as sent.
        state = await read_pickup_state(publisher, names, uuid.uuid4().hex)
        assert not state.stream.exists and state.record is None and not state.cancel_marked
        assert len(batches) == 1
    finally:
        await redis.delete(names.request_key(picked), names.cancel_key(picked), names.request_key(other))
        await redis.delete(names.stream_key(picked))
        await redis.aclose()


async def test_a_stream_interval_sends_fewer_events_with_the_same_tokens_and_text(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,  # noqa: F811
    unique_prefix: str,
    engine: AsyncEngine,  # noqa: F811
) -> None:
    request = request_for(max_tokens=40)
    ref = await reference_run(
        engine,
        engine.tokenizer(request.prompt)["input_ids"],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    )
    # An interval far longer than the request: its first token on its own, everything after it with its end.
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, stream_interval_ms=60_000) as w:
        await publish(w, request)
        events = await wait_terminal(w.redis, w.names, request.request_id)
    tokens = [e for e in events if e.type == "token"]
    assert [e.seq for e in events] == list(range(len(events)))  # contiguous seqs: clients see no gap
    assert [len(e.token_ids) for e in tokens] == [1, 39]
    assert [t for e in tokens for t in e.token_ids] == ref.token_ids
    assert "".join(e.text for e in tokens) == ref.text
    assert events[-1].type == "done" and events[-1].usage.completion_tokens == 40


async def test_the_default_interval_keeps_every_token(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,  # noqa: F811
    unique_prefix: str,
    engine: AsyncEngine,  # noqa: F811
) -> None:
    requests = [request_for(max_tokens=30) for _ in range(3)]
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, stream_interval_ms=5.0) as w:
        await publish(w, *requests)
        streams = await asyncio.gather(*(wait_terminal(w.redis, w.names, r.request_id) for r in requests))
    for events in streams:
        tokens = [t for e in events if e.type == "token" for t in e.token_ids]
        assert len(tokens) == 30 and events[-1].type == "done"
        assert len(events[0].token_ids) == 1  # the first token never waits for the interval
