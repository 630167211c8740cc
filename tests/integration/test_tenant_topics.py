"""Tenants apart on a real Kafka and Redis: a Kafka-native request on ``llm.inbound.<a>`` is served as tenant a (its
stream key and its result topic are a's), and a record on a's topic that names tenant b is refused to a's DLQ."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from ingress_support import MODEL, consume, reader, wait_partitions_owned
from redis.asyncio import Redis

from gpu_workers.worker.main import run_worker
from router.stream import run_router
from schemas import STREAM_FIELD, DeadLetter, FinalResult, InferenceRequest, parse_stream_event
from sluicegate.kafka import create_producer, ensure_topics
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tenant-model") / MODEL, num_layers=2, hidden_size=64)


async def test_the_topic_names_the_tenant(
    test_settings: Settings, redis: Redis, model_dir: Path, cleanup_topics: None
) -> None:
    settings = test_settings.model_copy(
        update={
            "tenant_topics": True,
            "tenants": "a,b",
            "topic_partitions": 1,
            "served_models": MODEL,
            "model": str(model_dir),
            "model_name": MODEL,
            "worker_id": "w-tenants",
            "engine_mode": "thread",
            "kv_cache_gb": 0.05,
            "drain_timeout_s": 5.0,
        }
    )
    names = settings.names
    inbound_a = names.tenant_inbound_topic("a")
    await ensure_topics(settings.kafka_bootstrap, {inbound_a: 1}, 1)
    served = InferenceRequest(request_id="tenant-served", model=MODEL, prompt="hello", sampling={"max_tokens": 3})
    # Names no tenant: the topic's. Sent as JSON without the field, as a Kafka-native producer would.
    plain = served.model_dump_json(exclude={"tenant"}).encode()
    forged = InferenceRequest(request_id="tenant-forged", model=MODEL, prompt="hi", tenant="b")
    producer = create_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(inbound_a, plain, key=b"s")
        await producer.send_and_wait(inbound_a, forged.model_dump_json().encode(), key=b"f")
    finally:
        await producer.stop()

    stop = asyncio.Event()
    router = asyncio.create_task(run_router(settings, stop=stop))
    worker = asyncio.create_task(run_worker(settings, stop))

    try:
        await wait_partitions_owned(redis, settings, MODEL, worker)
        async with (
            reader(settings, names.results_topic_of("a"), partitions=1) as results,
            reader(settings, names.dlq_topic_of("a"), partitions=1) as dlq,
        ):
            (result,) = [FinalResult.model_validate_json(r.value) for r in await consume(results, 1, timeout_s=120)]
            (letter,) = [DeadLetter.model_validate_json(r.value) for r in await consume(dlq, 1, timeout_s=60)]
        assert not router.done() and not worker.done()
    finally:
        stop.set()
        await asyncio.gather(asyncio.wait_for(router, 30), asyncio.wait_for(worker, 60))

    assert (result.request_id, result.tenant, result.finish_reason) == ("tenant-served", "a", "length")
    assert letter.reason == "tenant_mismatch" and letter.request_id == "tenant-forged"
    assert "'b'" in letter.detail and letter.source_topic == inbound_a
    # The stream keys carry the tenant: a's reader pattern covers them, and no key without it was written.
    served_events = await redis.xrange(names.stream_key("tenant-served", "a"))
    assert parse_stream_event(served_events[-1][1][STREAM_FIELD.encode()]).type == "done"
    refused = await redis.xrange(names.stream_key("tenant-forged", "a"))
    assert parse_stream_event(refused[0][1][STREAM_FIELD.encode()]).code == "tenant_mismatch"  # type: ignore[union-attr]
    assert await redis.exists(names.request_key("tenant-served", "a"))
    assert not await redis.exists(f"{names.prefix}llm:stream:tenant-served", names.stream_key("tenant-forged", "b"))
    # Nothing of a's reached the shared results topic.
    async with reader(settings, names.results_topic, partitions=1) as shared:
        assert not (await shared.getmany(timeout_ms=1000))
