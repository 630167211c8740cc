"""Cancels with tenants apart, on a real Kafka and Redis and a running worker: a cancel on ``llm.control.<b>``
naming tenant a's request (even naming tenant a in its body) stops nothing, before the request is picked up or
while it runs; the same cancel on ``llm.control.<a>`` stops it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ingress_support import eventually, wait_partitions_owned
from redis.asyncio import Redis

from gpu_workers.worker.main import run_worker
from schemas import (
    STREAM_FIELD,
    CancelRequest,
    DoneEvent,
    InferenceRequest,
    SamplingOptions,
    StreamEvent,
    parse_stream_event,
)
from schemas.names import HEADER_REQUEST_ID
from sluicegate.kafka import create_producer
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "tiny-cancels"


@pytest.fixture(scope="module")
def paced_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 layers, hidden 384 (a few ms a token): a long request is still generating when the test acts."""
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cancel-model") / MODEL, num_layers=6, hidden_size=384)


@pytest.fixture
async def worker_settings(
    test_settings: Settings, redis: Redis, paced_model_dir: Path, cleanup_topics: None
) -> AsyncIterator[Settings]:
    """A worker serving tenants a and b with their own control topics, running until the test ends."""
    settings = test_settings.model_copy(
        update={
            "tenant_topics": True,
            "tenants": "a,b",
            "topic_partitions": 1,
            "model": str(paced_model_dir),
            "model_name": MODEL,
            "worker_id": "w-cancels",
            "engine_mode": "thread",
            "kv_cache_gb": 0.05,
            "drain_timeout_s": 5.0,
            "heartbeat_interval_s": 0.3,
        }
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))

    try:
        await wait_partitions_owned(redis, settings, MODEL, worker)
        yield settings
        assert not worker.done(), worker.exception()
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)


def _request(rid: str, max_tokens: int) -> InferenceRequest:
    sampling = SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return InferenceRequest(
        request_id=rid, model=MODEL, prompt="The river ran past the mill", tenant="a", sampling=sampling
    )


async def _events(redis: Redis, settings: Settings, rid: str) -> list[StreamEvent]:
    entries = await redis.xrange(settings.names.stream_key(rid, "a"))
    return [parse_stream_event(fields[STREAM_FIELD.encode()]) for _, fields in entries]


async def _done(redis: Redis, settings: Settings, rid: str, timeout_s: float = 90) -> DoneEvent:
    async def ended() -> bool:
        events = await _events(redis, settings, rid)
        return bool(events) and events[-1].type in ("done", "error")

    await eventually(ended, timeout_s=timeout_s)
    last = (await _events(redis, settings, rid))[-1]
    assert isinstance(last, DoneEvent), last
    return last


async def test_a_cancel_on_another_tenants_control_topic_stops_nothing(
    worker_settings: Settings, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpu_workers.worker.control")
    settings, names = worker_settings, worker_settings.names
    producer = create_producer(settings)
    await producer.start()

    async def publish(request: InferenceRequest) -> None:
        headers = [(HEADER_REQUEST_ID, request.request_id.encode())]
        await producer.send_and_wait(
            names.request_topic(MODEL, "standard"), request.model_dump_json().encode(), headers=headers
        )

    async def cancel(tenant_topic: str, rid: str) -> None:
        # The body names tenant a whichever topic it goes on: only the topic counts.
        message = CancelRequest(request_id=rid, tenant="a", reason="client_cancelled")
        await producer.send_and_wait(names.control_topic_of(tenant_topic), message.model_dump_json().encode())

    def refused(rid: str) -> int:
        return sum(
            r.message == "worker.cancel_refused" and getattr(r, "request_id", None) == rid for r in caplog.records
        )

    try:
        # While it runs: b's cancel is heard and refused, and a's request goes on generating.
        running = _request("a-running", 1500)
        await publish(running)
        await eventually(lambda: _tokens_above(redis, settings, running.request_id, 0), timeout_s=60)
        await cancel("b", running.request_id)
        await eventually(lambda: _true(refused(running.request_id) == 1), timeout_s=30)
        seen = await _token_count(redis, settings, running.request_id)
        await eventually(lambda: _tokens_above(redis, settings, running.request_id, seen + 5), timeout_s=30)
        # a's own cancel stops it.
        await cancel("a", running.request_id)
        stopped = await _done(redis, settings, running.request_id)
        assert stopped.finish_reason == "abort" and seen < stopped.usage.completion_tokens < 1500

        # Before it is picked up: b's cancel is remembered as b's, and the request runs to its end.
        early = _request("a-early", 12)
        await cancel("b", early.request_id)
        await asyncio.sleep(1.0)  # the control consumer reads it before the request arrives
        await publish(early)
        served = await _done(redis, settings, early.request_id)
        assert served.finish_reason == "length" and served.usage.completion_tokens == 12
        assert refused(early.request_id) == 1
        # a's cancel ahead of its request keeps it from starting.
        never = _request("a-never", 12)
        await cancel("a", never.request_id)
        await asyncio.sleep(1.0)
        await publish(never)
        dropped = await _done(redis, settings, never.request_id)
        assert dropped.finish_reason == "abort" and dropped.usage.completion_tokens == 0
    finally:
        await producer.stop()
    print(f"\nCANCEL-ISOLATION refused={refused(running.request_id) + refused(early.request_id)} stopped_by_own=2")


async def _true(value: bool) -> bool:
    return value


async def _token_count(redis: Redis, settings: Settings, rid: str) -> int:
    return sum(len(getattr(e, "token_ids", ())) for e in await _events(redis, settings, rid))


async def _tokens_above(redis: Redis, settings: Settings, rid: str, count: int) -> bool:
    return await _token_count(redis, settings, rid) > count
