"""Priority under load and per-tenant fairness on the real pipeline (Kafka, Redis, service processes).

* An ``interactive`` request submitted while the worker is saturated with ``batch`` requests (more than its
  lookahead, so some wait in Kafka; every engine seat busy with long generations) reaches its first token
  within 2x its idle time to first token, plus an absolute slack for a shared 2-core machine; every batch
  request still finishes with all its tokens, preemption invisible in its stream.
* Tenant fairness inside a tier: tenant A floods the ``standard`` topic, then tenant B's two requests land
  on the same partition, behind the whole flood in Kafka (the worst case). The worker's lookahead and the
  engine's fair queuing serve B long before the flood drains (first-come-first-served would start B after
  every one of A's requests).

The engine runs 4 sequences at once (``SLUICEGATE_MAX_NUM_SEQS=4``) on the paced model, so saturation is real.
Each test prints a ``FAULT-REPORT`` line (run with ``-s``) with the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from schemas import STREAM_FIELD, DoneEvent, InferenceRequest, Names, SamplingOptions, TokenEvent, parse_stream_event
from schemas.names import HEADER_REQUEST_ID

from .conftest import MODEL_NAME, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

SEATS = 4
LOOKAHEAD = 4 * SEATS  # the worker's default: SLUICEGATE_WORKER_LOOKAHEAD unset
# Absolute allowance on top of 2x idle TTFT: scheduling noise of ~7 processes sharing 2 CPU cores.
TTFT_SLACK_S = 0.15
LOADED_SAMPLES = 7


def report(name: str, **figures: Any) -> None:
    print(f"\nFAULT-REPORT {json.dumps({'test': name, **figures})}")


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"SLUICEGATE_MAX_NUM_SEQS": str(SEATS), "OMP_NUM_THREADS": "1"}


def time_to_first_token(pipeline: Pipeline, **body: Any) -> tuple[str, float]:
    """Submit through ingress; seconds from the call until the first token event is in the Redis stream."""
    started = time.monotonic()
    rid = pipeline.submit(**body)["request_id"]
    key = Names(pipeline.prefix).stream_key(rid)
    # XREAD blocks until the (not yet existing) stream gets its first entry, so no polling interval adds up.
    reply = pipeline.redis().xread({key: "0-0"}, count=1, block=30_000)
    took = time.monotonic() - started
    assert reply, f"no token for {rid} within 30 s"
    event = parse_stream_event(reply[0][1][0][1][STREAM_FIELD.encode()])
    assert isinstance(event, TokenEvent), event
    return rid, took


def assert_finished_whole(pipeline: Pipeline, rid: str, max_tokens: int, timeout_s: float = 90) -> None:
    events = pipeline.wait_stream_end(rid, timeout_s)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length", done
    assert [e.seq for e in events] == list(range(len(events)))  # no restart: preemption is invisible
    tokens = sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))
    assert tokens == done.usage.completion_tokens == max_tokens


# Alone (tests/alone.py): its idle and loaded phases are a minute apart, and under pytest-xdist a pipeline starting
# on the other worker in one phase and not the other measured the neighbour (CI saw 0.5-0.9 s samples against
# 0.1-0.2 s idle, with the batch work itself running 2.6x slower than beside a steady CPU hog).
@pytest.mark.alone
def test_interactive_ttft_under_batch_saturation_stays_within_twice_idle(pipeline: Pipeline) -> None:
    chat = dict(prompt="Hello there, how are you", max_tokens=8, temperature=0, ignore_eos=True, priority="interactive")
    # The first request warms the worker (allocator, code paths); it is not measured.
    pipeline.wait_stream_end(time_to_first_token(pipeline, **chat)[0])
    idle = []
    for _ in range(5):
        rid, took = time_to_first_token(pipeline, **chat)
        idle.append(took)
        pipeline.wait_stream_end(rid)

    # More batch requests than the worker's lookahead: its batch partitions are paused with work still in
    # Kafka, every seat runs batch work and more of it waits in the engine.
    batch_tokens = 160

    def submit_batch(i: int) -> str:
        return pipeline.submit(
            prompt=f"Summarise report number {i} of the quarterly archive",
            max_tokens=batch_tokens,
            temperature=0,
            ignore_eos=True,
            priority="batch",
        )["request_id"]

    batch = [submit_batch(i) for i in range(6 * SEATS)]
    deadline = time.monotonic() + 30
    while not any(b.running == SEATS and b.waiting > 0 for b in pipeline.heartbeats().values()):
        assert time.monotonic() < deadline, pipeline.heartbeats()
        time.sleep(0.05)
    loaded = []
    for _ in range(LOADED_SAMPLES):
        # Kept topped up: a fast machine drains the first load before the samples are all taken.
        while _unfinished(pipeline, batch) <= LOOKAHEAD + SEATS:
            batch.append(submit_batch(len(batch)))
        # The worker holds a full lookahead of batch work: only its per-tier room lets this request in.
        assert _unfinished(pipeline, batch) > LOOKAHEAD, "the batch load drained too early to measure"
        rid, took = time_to_first_token(pipeline, **chat)
        loaded.append(took)
        assert_finished_whole(pipeline, rid, 8, timeout_s=30)
        time.sleep(0.2)
    for rid in batch:
        assert_finished_whole(pipeline, rid, batch_tokens)
    # The first batch requests to finish held their seats from the start of the load: how long an interactive
    # request would have waited for a seat had it no way past the batch work.
    seat_wait_s = min(_latency_seconds(pipeline, rid) for rid in batch)

    idle_ttft, loaded_ttft = statistics.median(idle), statistics.median(loaded)
    report(
        "priority_under_load",
        idle_ttft_ms=[round(t * 1000, 1) for t in idle],
        loaded_ttft_ms=[round(t * 1000, 1) for t in loaded],
        idle_median_ms=round(idle_ttft * 1000, 1),
        loaded_median_ms=round(loaded_ttft * 1000, 1),
        ratio=round(loaded_ttft / idle_ttft, 2),
        batch_requests=len(batch),
        batch_seat_wait_ms=round(seat_wait_s * 1000, 1),
        seats=SEATS,
        lookahead=LOOKAHEAD,
        slack_ms=TTFT_SLACK_S * 1000,
    )
    assert loaded_ttft <= 2 * idle_ttft + TTFT_SLACK_S, (idle, loaded)
    # The tail: a request that had to wait for a batch seat to free would wait up to a whole batch generation
    # (seconds), so none may come near half of one. Beyond that, one sample may be caught by a burst of the ~7
    # processes sharing the box; more than one over the tight bound is a regression.
    assert max(loaded) < seat_wait_s / 2, (loaded, seat_wait_s)
    over = [t for t in loaded if t > 2 * max(idle) + 2 * TTFT_SLACK_S]
    assert len(over) <= 1, (idle, loaded)


def test_a_flooding_tenant_does_not_starve_another_tenant_of_its_tier(pipeline: Pipeline) -> None:
    """B's requests sit behind A's whole flood on one partition. The worker's lookahead (4 x 4 seats) reaches
    them once flood - 16 of A's requests have finished, and the engine's fair queue then gives B the next
    seats, so about lookahead - seats of A's requests still start after B's, however deep the flood."""
    names = Names(pipeline.prefix)
    topic = names.request_topic(MODEL_NAME, "standard")
    flood_size = 20
    flood = [_request("tenant-a", i, max_tokens=24 + 8 * (i % 4)) for i in range(flood_size)]
    late = [_request("tenant-b", i, max_tokens=32) for i in range(2)]
    asyncio.run(_produce(pipeline.kafka_bootstrap, topic, [*flood, *late]))
    ids = [r.request_id for r in [*flood, *late]]
    first, done = _watch(pipeline, ids, timeout_s=90)

    a_ids, b_ids = ids[:flood_size], ids[flood_size:]
    a_first = sorted(first[rid] for rid in a_ids)
    a_done = sorted(done[rid] for rid in a_ids)
    # How many of A's requests started (finished) after each of B's.
    started_after = [sum(t > first[rid] for t in a_first) for rid in b_ids]
    finished_after = [sum(t > done[rid] for t in a_done) for rid in b_ids]
    for request in [*flood, *late]:
        assert_finished_whole(pipeline, request.request_id, request.sampling.max_tokens)
    report(
        "tenant_fairness",
        flood=flood_size,
        a_started_after_b=started_after,
        a_finished_after_b=finished_after,
        b_first_token_s=[round(first[rid] - min(a_first), 2) for rid in b_ids],
        b_done_s=[round(done[rid] - min(a_first), 2) for rid in b_ids],
        a_flood_done_s=round(max(a_done) - min(a_first), 2),
    )
    # First-come-first-served would start B after every A request (0 started after) and finish it after all
    # but the few longest of them.
    assert min(started_after) >= 8, started_after
    assert min(finished_after) >= 6, finished_after


def _latency_seconds(pipeline: Pipeline, rid: str) -> float:
    """Submit to finish by the request's status record (ingress writes ``created_at``, the worker the end)."""
    record = pipeline.wait_record(rid, "finished")
    return (record.updated_at - record.created_at).total_seconds()


def _unfinished(pipeline: Pipeline, ids: list[str]) -> int:
    return sum(not any(e.type == "done" for e in pipeline.stream_events(rid)) for rid in ids)


def _request(tenant: str, index: int, max_tokens: int) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"{tenant}-{index}-{uuid.uuid4().hex[:8]}",
        model=MODEL_NAME,
        prompt=f"Request {index} from {tenant}: list the rivers of the northern plains",
        sampling=SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        priority="standard",
        tenant=tenant,
    )


async def _produce(bootstrap: str, topic: str, requests: list[InferenceRequest]) -> None:
    """Produce the requests in order to partition 0 of ``topic``."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for request in requests:
            await producer.send_and_wait(
                topic,
                request.model_dump_json().encode(),
                key=request.request_id.encode(),
                partition=0,
                headers=[(HEADER_REQUEST_ID, request.request_id.encode())],
            )
    finally:
        await producer.stop()


def _watch(pipeline: Pipeline, ids: list[str], timeout_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """Poll every stream until each has ended; when each request's first token and ``done`` were first seen."""
    names = Names(pipeline.prefix)
    client = pipeline.redis()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"{len(ids) - len(done)} requests unfinished"
        pending = [rid for rid in ids if rid not in done]
        pipe = client.pipeline(transaction=False)
        for rid in pending:
            pipe.xrevrange(names.stream_key(rid), count=1)
        now = time.monotonic()
        for rid, entries in zip(pending, pipe.execute(), strict=True):
            if entries:
                first.setdefault(rid, now)
                if parse_stream_event(entries[0][1][STREAM_FIELD.encode()]).type in ("done", "error"):
                    done[rid] = now
        time.sleep(0.005)
    return first, done
