"""Tenant fairness in a real worker's intake (real Kafka, Redis and engine): tenant A's backlog of long prompts sits
ahead of tenant B's short ones on the one partition, and the worker starts B's before A's backlog drains.

The engine has one seat and the worker starts at most two requests at once (``worker_lookahead=2``), so without
the intake's fair queue the records would start in Kafka order: every one of A's before any of B's. The worker
holds up to 32 fetched records (``worker_intake_hold``) and starts them by tokens: A's first held start costs its
64-token prompt plus 8 output tokens (72), B's 8 + 8 (16), so B's three start before A's third. The order is
observed in the Redis streams (one seat: a request's stream appears when it runs), not by timing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis
from start_order import finish_order, stream_done

from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.worker.main import run_worker
from schemas import InferenceRequest, Names, SamplingOptions, WorkerHeartbeat
from schemas.names import HEADER_REQUEST_ID
from sluicegate.kafka import create_admin, create_producer
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "tiny-fair"
LONG_PROMPT = list(range(5, 69))  # 64 tokens: tenant A's prompts are 8x tenant B's
SHORT_PROMPT = list(range(5, 13))  # 8 tokens


def _request(rid: str, tenant: str, prompt: list[int], max_tokens: int) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid,
        model=MODEL,
        tenant=tenant,
        prompt=prompt,
        sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def test_a_tenants_short_requests_start_before_anothers_long_backlog_drains(
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
        worker_id="w-fair",
        kv_cache_gb=0.05,
        heartbeat_interval_s=0.3,
        drain_timeout_s=5.0,
        max_num_seqs=1,
        worker_lookahead=2,  # one running, one waiting in the engine: the intake decides the order
        worker_intake_hold=32,  # every record below is held, so the fair queue sees B's behind A's backlog
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

        # A's long request takes the seat; A's backlog, then B's requests, arrive while it runs.
        await send(_request("holder", "tenant-a", LONG_PROMPT, 400))
        until = time.monotonic() + 30
        while not await redis.exists(names.stream_key("holder")):
            assert time.monotonic() < until, "the holder never started"
            await asyncio.sleep(0.01)
        backlog = [f"a{i}" for i in range(1, 7)]
        shorts = [f"b{i}" for i in range(1, 4)]
        for rid in backlog:
            await send(_request(rid, "tenant-a", LONG_PROMPT, 8))
        for rid in shorts:
            await send(_request(rid, "tenant-b", SHORT_PROMPT, 8))
        assert not await stream_done(redis, names, "holder"), "the holder finished first: too fast a box?"
        # One seat: each starts after the one before it finished, so the finish order is the start order.
        order = await finish_order(redis, names, [*backlog, *shorts], timeout_s=120)
        # In Kafka order B's would start after all six of A's; by tokens they start before A's third.
        last_short = max(order.index(rid) for rid in shorts)
        assert last_short < order.index("a3"), order
        assert [rid for rid in order if rid in backlog] == backlog, order  # one tenant's records keep their order
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
