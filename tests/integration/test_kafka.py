"""Kafka client setup against a real broker: topic creation, manual commits and resume, idempotent
producers, and interoperability with another Kafka client (kafka-python)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord
from kafka import KafkaAdminClient, KafkaProducer
from kafka import TopicPartition as KpTopicPartition

from sluicegate.kafka import create_admin, create_consumer, create_producer, ensure_topics, wait_for_kafka
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TopicMaker = Callable[[str, int], Awaitable[str]]


@pytest.fixture
async def make_topic(test_settings: Settings) -> AsyncIterator[TopicMaker]:
    """Creates prefixed topics for one test and deletes them afterwards."""
    admin = create_admin(test_settings)
    await admin.start()
    created: list[str] = []

    async def make(name: str, partitions: int) -> str:
        full = f"{test_settings.topic_prefix}{name}"
        await ensure_topics(admin, {full: partitions}, replication=1)
        created.append(full)
        return full

    yield make
    if created:
        await admin.delete_topics(created)
    await admin.close()


async def _consume(consumer: AIOKafkaConsumer, count: int, timeout_s: float = 30.0) -> list[ConsumerRecord]:
    """Exactly ``count`` records (fails on more within a short grace period, or fewer by the deadline)."""
    records: list[ConsumerRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=500)
        for partition_records in batch.values():
            records.extend(partition_records)
    extra = await consumer.getmany(timeout_ms=300)
    records.extend(r for partition_records in extra.values() for r in partition_records)
    assert len(records) == count, f"expected {count} records, got {len(records)}"
    return records


async def test_wait_for_kafka_reports_cluster(kafka_bootstrap: str) -> None:
    cluster = await wait_for_kafka(kafka_bootstrap, timeout_s=10)
    assert cluster["brokers"], cluster
    assert cluster["controller_id"] >= 0


async def test_wait_for_kafka_times_out_on_closed_port() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not ready"):
        await wait_for_kafka("127.0.0.1:1", timeout_s=1.0)
    assert time.monotonic() - started < 5


async def test_ensure_topics_creates_partitions_and_is_idempotent(test_settings: Settings) -> None:
    names = {f"{test_settings.topic_prefix}a": 3, f"{test_settings.topic_prefix}b": 1}
    admin = create_admin(test_settings)
    await admin.start()
    try:
        assert await ensure_topics(admin, names, replication=1) == names
        # Second call: topics exist, nothing fails, counts unchanged (asking for more does not alter them).
        again = {**names, f"{test_settings.topic_prefix}a": 5}
        assert await ensure_topics(test_settings.kafka_bootstrap, again, replication=1) == names

        described = {t["topic"]: t for t in await admin.describe_topics(list(names))}
        for name, partitions in names.items():
            assert described[name]["error_code"] == 0
            assert sorted(p["partition"] for p in described[name]["partitions"]) == list(range(partitions))
        assert set(names) <= set(await admin.list_topics())
    finally:
        await admin.delete_topics(list(names))
        await admin.close()


async def test_ensure_topics_rejects_bad_input(kafka_bootstrap: str) -> None:
    with pytest.raises(ValueError, match="partitions >= 1"):
        await ensure_topics(kafka_bootstrap, {"x": 0})


async def test_consumer_resumes_after_committed_offsets(test_settings: Settings, make_topic: TopicMaker) -> None:
    topic = await make_topic("requests", 3)
    group = f"{test_settings.topic_prefix}workers"
    producer = create_producer(test_settings)
    await producer.start()
    try:
        for partition in range(3):
            for i in range(6):
                await producer.send_and_wait(topic, f"p{partition}-m{i}".encode(), partition=partition)
    finally:
        await producer.stop()

    # First worker: reads everything, commits only the first half of each partition (a watermark),
    # then goes away without committing the rest.
    first = create_consumer(topic, group_id=group, settings=test_settings)
    await first.start()
    try:
        records = await _consume(first, 18)
        assert {r.value for r in records} == {f"p{p}-m{i}".encode() for p in range(3) for i in range(6)}
        half = {TopicPartition(topic, p): 3 for p in range(3)}  # next offset to read = 3
        await first.commit(half)
    finally:
        await first.stop()

    # Second worker, same group: resumes at the committed offsets; uncommitted records come again.
    second = create_consumer(topic, group_id=group, settings=test_settings)
    await second.start()
    try:
        for tp in half:
            assert await second.committed(tp) == 3
        redelivered = await _consume(second, 9)
        assert {r.value for r in redelivered} == {f"p{p}-m{i}".encode() for p in range(3) for i in range(3, 6)}
        assert all(r.offset >= 3 for r in redelivered)
    finally:
        await second.stop()


async def test_producer_is_idempotent_on_the_broker(test_settings: Settings, make_topic: TopicMaker) -> None:
    """The broker tracks a producer id and sequence numbers only for idempotent producers."""
    topic = await make_topic("idem", 2)
    producer = create_producer(test_settings)
    plain = AIOKafkaProducer(bootstrap_servers=test_settings.kafka_bootstrap, acks=1, enable_idempotence=False)
    await producer.start()
    await plain.start()
    try:
        for i in range(5):
            await producer.send_and_wait(topic, f"m{i}".encode(), partition=0)
        await plain.send_and_wait(topic, b"plain", partition=1)
    finally:
        await producer.stop()
        await plain.stop()

    def describe() -> dict[int, list[tuple[int, int]]]:
        admin = KafkaAdminClient(bootstrap_servers=test_settings.kafka_bootstrap)
        try:
            states = admin.describe_producers([KpTopicPartition(topic, 0), KpTopicPartition(topic, 1)])
        finally:
            admin.close()
        return {
            tp.partition: [(p.producer_id, p.last_sequence) for p in state.active_producers]
            for tp, state in states.items()
        }

    active = await asyncio.to_thread(describe)
    assert len(active[0]) == 1, active
    producer_id, last_sequence = active[0][0]
    assert producer_id >= 0
    assert last_sequence == 4  # sequences 0..4, one per record
    assert active[1] == []  # the non-idempotent producer left no producer state


async def test_kafka_python_produces_aiokafka_consumes(test_settings: Settings, make_topic: TopicMaker) -> None:
    topic = await make_topic("interop", 1)

    def produce() -> None:
        producer = KafkaProducer(bootstrap_servers=test_settings.kafka_bootstrap, acks="all")
        try:
            for i in range(3):
                producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), headers=[("h", b"x")])
            producer.flush(timeout=30)
        finally:
            producer.close()

    await asyncio.to_thread(produce)

    consumer = create_consumer(topic, group_id=f"{test_settings.topic_prefix}interop", settings=test_settings)
    await consumer.start()
    try:
        records = sorted(await _consume(consumer, 3), key=lambda r: r.offset)
    finally:
        await consumer.stop()
    assert [(r.key, r.value) for r in records] == [(f"k{i}".encode(), f"v{i}".encode()) for i in range(3)]
    assert all(list(r.headers) == [("h", b"x")] for r in records)


async def test_foreign_client_request_is_schema_valid_and_read_by_our_consumer(
    test_settings: Settings, make_topic: TopicMaker
) -> None:
    """A producer in another stack writes plain JSON checked only against schemas/json; we read and validate it."""
    import json

    import jsonschema
    from pydantic import ValidationError

    from schemas import InferenceRequest
    from schemas.export import JSON_DIR

    topic = await make_topic("foreign", 1)
    schema = json.loads((JSON_DIR / "InferenceRequest.json").read_text())
    good = {
        "request_id": "foreign-1",
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "sampling": {"temperature": 0, "max_tokens": 4},
        "priority": "batch",
        "deadline": "2099-01-01T00:00:00Z",
    }
    bad = {"request_id": "foreign-2", "model": "tiny", "prompt": "x", "sampling": {"top_p": 3}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)

    def produce() -> None:
        producer = KafkaProducer(bootstrap_servers=test_settings.kafka_bootstrap, acks="all")
        try:
            for body in (good, bad):
                producer.send(topic, value=json.dumps(body).encode())
            producer.flush(timeout=30)
        finally:
            producer.close()

    await asyncio.to_thread(produce)
    consumer = create_consumer(topic, group_id=f"{test_settings.topic_prefix}foreign", settings=test_settings)
    await consumer.start()
    try:
        first, second = sorted(await _consume(consumer, 2), key=lambda r: r.offset)
    finally:
        await consumer.stop()
    request = InferenceRequest.model_validate_json(first.value)
    assert (request.request_id, request.priority, request.sampling.max_tokens) == ("foreign-1", "batch", 4)
    with pytest.raises(ValidationError) as info:
        InferenceRequest.model_validate_json(second.value)
    assert any(err["loc"][:2] == ("sampling", "top_p") for err in info.value.errors())
