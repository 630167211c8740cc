"""The intake's batched commits on a real broker: a request that finishes while a commit is on its way to the
broker gets a commit of its own once that one returns, instead of waiting for some later request to finish.

The consumer is aiokafka's, in a consumer group on the test broker; only its ``commit`` is held in flight until
the test lets it go on to the broker, which is the one moment a real broker cannot produce on cue.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import InFlight
from gpu_workers.worker.intake import Intake
from schemas import Names

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class HeldCommits(AIOKafkaConsumer):
    """aiokafka's consumer, each commit recorded and held until ``release`` is set, then sent to the broker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commits: list[dict[TopicPartition, int]] = []
        self.release = asyncio.Event()
        self.in_flight = asyncio.Event()

    async def commit(self, offsets: Any = None) -> None:
        self.commits.append(dict(offsets))
        self.in_flight.set()
        await self.release.wait()
        await super().commit(offsets)


async def test_a_finish_during_a_commit_is_committed_after_it(kafka_bootstrap: str, unique_prefix: str) -> None:
    tp = TopicPartition(f"{unique_prefix}requests", 0)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:  # two records, offsets 0 and 1 (the broker creates the topic)
        for _ in range(2):
            await producer.send_and_wait(tp.topic, b"r", partition=0)
    finally:
        await producer.stop()
    consumer = HeldCommits(bootstrap_servers=kafka_bootstrap, group_id=f"g-{uuid.uuid4().hex[:8]}")
    await consumer.start()
    consumer.assign([tp])
    try:
        intake = Intake(
            consumer=consumer,
            engine=None,  # type: ignore[arg-type]
            config=WorkerConfig(model_name="m", worker_id="w", commit_interval_s=0.01),
            names=Names(),
            in_flight=InFlight(),
            serving=None,  # type: ignore[arg-type]
            outputs=None,  # type: ignore[arg-type]
            stopping=asyncio.Event(),
        )
        for offset in (0, 1):
            intake.watermarks.started(tp, offset)
        intake.watermarks.finished(tp, 0)
        intake._schedule_commit()
        await asyncio.wait_for(consumer.in_flight.wait(), 5)
        assert consumer.commits == [{tp: 1}]
        # Offset 1 finishes while the commit of offset 0 is still on its way.
        intake.watermarks.finished(tp, 1)
        intake._schedule_commit()
        consumer.release.set()
        task: Any = intake._commit_task
        await asyncio.wait_for(task, 10)
        assert consumer.commits == [{tp: 1}, {tp: 2}]
        assert await consumer.committed(tp) == 2  # the broker holds it
    finally:
        await consumer.stop()
