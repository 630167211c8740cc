"""Kafka-native producers compress as they like: records a librdkafka producer (confluent-kafka, the client under
most non-Python stacks) compressed with each of Kafka's codecs are routed by the router on a real broker.

A consumer that cannot decode a batch cannot read past it: before the codecs were a dependency, one lz4 record
in ``llm.inbound`` stopped the router at every restart, and every request behind it with it.
"""

from __future__ import annotations

import asyncio

import pytest
from ingress_support import MODEL, consume, reader
from needs import require_import

from router.stream import run_router
from schemas import InferenceRequest, Names
from sluicegate.kafka import ensure_topics
from sluicegate.settings import Settings

confluent_kafka = require_import("confluent_kafka", "pip install -e '.[dev]'")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CODECS = ("gzip", "snappy", "lz4", "zstd")


@pytest.fixture
def settings(test_settings: Settings) -> Settings:
    # The model is served: its records are queued for a worker even while none is beating.
    return test_settings.model_copy(update={"topic_partitions": 3, "served_models": MODEL})


def _produce_compressed(settings: Settings, topic: str, codec: str, request: InferenceRequest) -> None:
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "compression.type": codec,
            "enable.idempotence": True,
            "acks": "all",
        }
    )
    errors: list[object] = []
    producer.produce(
        topic,
        value=request.model_dump_json().encode(),
        key=request.request_id.encode(),
        on_delivery=lambda err, _msg: errors.append(err) if err is not None else None,
    )
    assert producer.flush(30) == 0 and not errors, f"{codec}: not delivered: {errors}"


async def test_records_compressed_with_every_codec_are_routed(settings: Settings, cleanup_topics: None) -> None:
    names = Names(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: 3}, 1)
    sent = {codec: InferenceRequest(request_id=f"codec-{codec}", model=MODEL, prompt="x") for codec in CODECS}
    for codec, request in sent.items():
        await asyncio.to_thread(_produce_compressed, settings, names.inbound_topic, codec, request)
    stop = asyncio.Event()
    router = asyncio.create_task(run_router(settings, stop=stop))
    try:
        async with reader(settings, names.request_topic(MODEL, "standard"), partitions=3) as routed_reader:
            routed = await consume(routed_reader, len(CODECS), timeout_s=60)
        assert not router.done(), "the router stopped"
    finally:
        stop.set()
        await asyncio.wait_for(router, 15)
    got = {InferenceRequest.model_validate_json(record.value).request_id for record in routed}
    assert got == {request.request_id for request in sent.values()}
