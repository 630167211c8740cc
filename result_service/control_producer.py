"""The result service's Kafka producer for the control topic, started on the first cancellation.

Starting it lazily means relaying streams never depends on Kafka being reachable; the app warms it
up in the background so the first Stop need not wait. It lends itself to the one cancel path
(:class:`sluicegate.cancellation.Canceller`) as its ``producer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import Names
from sluicegate.kafka import ensure_topics, start_client
from sluicegate.settings import KafkaSettings

log = logging.getLogger(__name__)


class ControlProducer:
    """One producer, created by ``factory`` and started (control topic ensured first) on first use."""

    def __init__(
        self,
        factory: Callable[[], AIOKafkaProducer],
        names: Names,
        *,
        kafka: KafkaSettings | None = None,
        topic_replication: int = 1,
        timeout_s: float = 10.0,
    ) -> None:
        self._factory = factory
        self._names = names
        # Where to create the control topic (one partition: cancellations go to every worker) before
        # the first publish; None when something else creates it.
        self._kafka = kafka
        self._topic_replication = topic_replication
        self._timeout_s = timeout_s
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                if self._kafka is not None:
                    await ensure_topics(
                        self._kafka.kafka_bootstrap,
                        {self._names.control_topic: 1},
                        self._topic_replication,
                        timeout_s=self._timeout_s,
                        settings=self._kafka,
                    )
                producer = self._factory()
                try:
                    await asyncio.wait_for(start_client(producer, self._kafka), self._timeout_s)
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
            return self._producer

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[AIOKafkaProducer]:
        """The started producer; raises KafkaError, TimeoutError or OSError when Kafka does not answer."""
        yield await self._started()

    async def warm_up(self) -> None:
        """Connect to Kafka ahead of the first cancellation; failure is only logged (retried on use)."""
        try:
            await self._started()
        except (KafkaError, TimeoutError, OSError) as exc:
            log.warning("relay.kafka_not_ready error=%r; cancellations will retry on use", exc)

    async def aclose(self) -> None:
        """Stop the producer, if started."""
        async with self._lock:
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None
