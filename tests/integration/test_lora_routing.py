"""The router stream processor on real Kafka and Redis routes a Kafka-native request for a LoRA adapter to the
partition of a worker whose heartbeat lists the adapter, on the base model's topic; a base-model request with the
same prompt keeps its key's partition."""

from __future__ import annotations

import asyncio

import pytest
from ingress_support import MODEL, consume, reader
from redis.asyncio import Redis

from router import KeyPolicy
from router.policy import affinity_prefix, key_partition, partition_key
from router.stream import run_router
from schemas import InferenceRequest, Names, PartitionRef, WorkerHeartbeat
from sluicegate.kafka import create_producer, ensure_topics
from sluicegate.lora.registry import LoRARegistry
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PARTITIONS = 3


async def test_an_adapter_request_goes_to_the_worker_holding_it(
    test_settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    settings = test_settings.model_copy(update={"topic_partitions": PARTITIONS, "heartbeat_interval_s": 1.0})
    names = Names(settings.topic_prefix)
    topic = names.request_topic(MODEL, "standard")
    await LoRARegistry(redis, names.prefix).register("sql", MODEL, "/srv/adapters/sql")
    base = InferenceRequest(request_id="base-1", model=MODEL, prompt="SELECT the answer")
    tuned = base.model_copy(update={"request_id": "lora-1", "adapter": "sql"})
    # The adapter request's key hashes to a partition of a worker without the adapter; the holder owns the rest.
    adapter_key = partition_key(MODEL, affinity_prefix(tuned, KeyPolicy()), "sql")
    home = key_partition(adapter_key, PARTITIONS)
    holder_partitions = [p for p in range(PARTITIONS) if p != home]
    for worker, owned, adapters in (("plain", [home], []), ("holder", holder_partitions, ["sql", "chat"])):
        beat = WorkerHeartbeat(
            worker_id=worker,
            model=MODEL,
            partitions=[PartitionRef(topic=topic, partition=p) for p in owned],
            running=1,
            waiting=0,
            free_kv_blocks=100,
            total_kv_blocks=100,
            prefix_cache_hit_rate=0.0,
            adapters=adapters,
        )
        await redis.hset(names.workers_key(MODEL), worker, beat.model_dump_json())

    stop = asyncio.Event()
    task = asyncio.create_task(run_router(settings, stop=stop))
    producer = create_producer(settings)
    await producer.start()
    try:
        await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: PARTITIONS}, 1)
        for request in (tuned, base):
            await producer.send_and_wait(names.inbound_topic, request.model_dump_json().encode(), key=b"k")
        async with reader(settings, topic, partitions=PARTITIONS) as consumer:
            records = await consume(consumer, 2, timeout_s=30)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 15)

    routed = {InferenceRequest.model_validate_json(r.value).request_id: r for r in records}
    assert set(routed) == {"lora-1", "base-1"}
    lora_record = routed["lora-1"]
    assert InferenceRequest.model_validate_json(lora_record.value).adapter == "sql"
    assert lora_record.partition in holder_partitions and lora_record.key == adapter_key
    # The base-model request is keyed without the adapter and stays on its own key's partition.
    base_key = partition_key(MODEL, affinity_prefix(base, KeyPolicy()))
    assert routed["base-1"].key == base_key and routed["base-1"].partition == key_partition(base_key, PARTITIONS)
