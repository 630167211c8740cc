"""Keeps a :class:`router.kv_index.KVIndex` current: reads ``llm.kv_events`` from its end (no consumer group: every
routing process needs every worker's events) and asks the workers for snapshots on ``llm.control`` once it is
positioned, and again whenever a worker's picture is incomplete (a gap in its seq, or first heard of mid-stream),
at most once per ``ask_interval_s``. Used by ingress (for the requests it routes in-process) and by the router
stream processor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from schemas import KVCacheEvents, KVSnapshotRequest
from sluicegate.kafka import create_consumer, create_producer, ensure_topics
from sluicegate.settings import BackboneSettings
from sluicegate.task_stop import cancel_and_wait
from sluicegate.telemetry import untraced

from .kv_index import KVIndex

log = logging.getLogger(__name__)


class KVFollower:
    """One background task per process: ``start()``, ``close()``."""

    def __init__(
        self, settings: BackboneSettings, index: KVIndex, *, service: str, ask_interval_s: float = 1.0
    ) -> None:
        self.settings = settings
        self.names = settings.names
        self.index = index
        self.requested_by = f"{service}-{uuid.uuid4().hex[:12]}"
        self.ask_interval_s = ask_interval_s
        self.messages = 0
        self.snapshots_asked = 0
        self._last_ask = float("-inf")
        self._ask_pending = False
        self._task: asyncio.Task[None] | None = None
        self.positioned = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run_forever(), name="kv-events-follower")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run_forever(self) -> None:
        """Follow; a Kafka failure is logged and retried (routing falls back to the key meanwhile)."""
        while True:
            try:
                await self._follow()
            except (KafkaError, OSError, TimeoutError) as exc:
                log.warning("router.kv_events_failed error=%r; retrying", exc)
                await asyncio.sleep(1.0)

    async def _follow(self) -> None:
        settings = self.settings
        topics = {self.names.kv_events_topic: settings.topic_partitions, self.names.control_topic: 1}
        with untraced():
            await ensure_topics(settings.kafka_bootstrap, topics, settings.topic_replication, settings=settings)
        consumer = create_consumer(
            self.names.kv_events_topic,
            group_id=None,
            settings=settings,
            auto_offset_reset="latest",
            client_id=f"sluicegate-kv-{self.requested_by}",
        )
        producer = create_producer(settings, client_id=f"sluicegate-kv-{self.requested_by}")
        await consumer.start()
        try:
            await producer.start()
            # Positioned at the end before asking: the snapshots the ask brings are read, not skipped.
            for tp in consumer.assignment():
                await consumer.position(tp)
            self.positioned.set()
            await self._ask(producer, force=True)
            async for record in consumer:
                try:
                    message = KVCacheEvents.model_validate_json(record.value)
                except ValidationError:
                    log.warning("router.bad_kv_events offset=%s", record.offset)
                    continue
                self.messages += 1
                if not self.index.apply(message) or self._ask_pending:
                    await self._ask(producer)
        finally:
            with contextlib.suppress(Exception):
                await producer.stop()
            await consumer.stop()

    async def _ask(self, producer: AIOKafkaProducer, *, force: bool = False) -> None:
        """Ask every worker for a snapshot, unless one was asked for within ``ask_interval_s`` (then the next
        message read asks, once that has passed)."""
        now = time.monotonic()
        if not force and now - self._last_ask < self.ask_interval_s:
            self._ask_pending = True
            return
        self._last_ask = now
        self._ask_pending = False
        self.snapshots_asked += 1
        request = KVSnapshotRequest(requested_by=self.requested_by)
        await producer.send_and_wait(self.names.control_topic, request.model_dump_json().encode())
