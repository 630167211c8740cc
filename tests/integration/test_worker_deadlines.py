"""Earliest-deadline-first through a real worker (real Kafka, Redis and engine): with the engine's one seat taken,
requests published in shuffled deadline order start in deadline order, and the one without a deadline, though
published first, starts after them."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from datetime import timedelta
from pathlib import Path

import pytest
from redis.asyncio import Redis
from start_order import finish_order, stream_done

from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.worker.main import run_worker
from schemas import InferenceRequest, Names, SamplingOptions, WorkerHeartbeat, utcnow
from schemas.names import HEADER_REQUEST_ID
from sluicegate.kafka import create_admin, create_producer
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "tiny-edf"


def _request(rid: str, max_tokens: int, deadline_s: float | None) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        model=MODEL,
        prompt=[5, 6, 7, 8],
        sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        deadline=None if deadline_s is None else utcnow() + timedelta(seconds=deadline_s),
    )


async def test_a_worker_starts_what_it_holds_earliest_deadline_first(
    kafka_bootstrap: str, redis_url: str, unique_prefix: str, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(tmp_path / MODEL, num_layers=2, hidden_size=64)
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=unique_prefix,
        topic_partitions=1,
        model=str(model_dir),
        model_name=MODEL,
        worker_id="w-edf",
        kv_cache_gb=0.05,
        heartbeat_interval_s=0.3,
        drain_timeout_s=5.0,
        max_num_seqs=1,
        worker_lookahead=16,  # the worker holds every request below, so the engine's queue orders them
    )
    names = Names(unique_prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, stop))
    redis = Redis.from_url(redis_url)
    producer = create_producer(settings)
    try:
        until = time.monotonic() + 60
        while not any(
            WorkerHeartbeat.model_validate_json(v).partitions
            for v in (await redis.hgetall(names.workers_key(MODEL))).values()
        ):
            assert not task.done(), task.exception()
            assert time.monotonic() < until, "the worker never owned its partition"
            await asyncio.sleep(0.1)
        await producer.start()
        topic = names.request_topic(MODEL, "standard")

        async def send(request: InferenceRequest) -> None:
            headers = [(HEADER_REQUEST_ID, request.request_id.encode())]
            await producer.send_and_wait(topic, request.model_dump_json().encode(), headers=headers)

        # The seat is taken by a long request; then the rest arrive while it runs.
        await send(_request("holder", 400, None))
        until = time.monotonic() + 30
        while not await redis.exists(names.stream_key("holder")):
            assert time.monotonic() < until, "the holder never started"
            await asyncio.sleep(0.01)
        with_deadline = [f"d{i}" for i in range(4)]
        shuffled = random.Random(3).sample(with_deadline, len(with_deadline))
        await send(_request("plain", 12, None))
        for rid in shuffled:
            await send(_request(rid, 12, 100 + 50 * int(rid[1:])))
        assert not await stream_done(redis, names, "holder"), "the holder finished first: too fast a box?"
        # One seat: each starts after the one before it finished, so the finish order is the start order.
        order = await finish_order(redis, names, ["plain", *with_deadline], timeout_s=90)
        assert order == [*with_deadline, "plain"]
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await producer.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        admin = create_admin(bootstrap=kafka_bootstrap)
        await admin.start()
        with contextlib.suppress(Exception):
            await admin.delete_topics([t for t in await admin.list_topics() if t.startswith(unique_prefix)])
        await admin.close()
