"""Ingress's pool of idempotent Kafka producers: started together on first use, restarted after a failed start,
and leased to each publish by the fewest publishes in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError

from sluicegate.kafka import create_producer, start_client
from sluicegate.settings import IngressSettings


@dataclass(eq=False)
class _Slot:
    producer: AIOKafkaProducer
    #: Publishes handed to this producer and not yet acknowledged (or failed).
    in_flight: int = 0


class ProducerPool:
    """Ingress's idempotent producers, started together on first use and restarted after a failed start.

    aiokafka sends one produce request at a time per producer and broker: a record handed to a producer
    whose last request is unacknowledged waits for that acknowledgement (about a millisecond). ``lease`` hands
    out the producer with the fewest publishes in flight, so concurrent publishes rarely queue.
    """

    def __init__(self, settings: IngressSettings) -> None:
        self._settings = settings
        self._slots: list[_Slot] = []
        self._lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        """Whether the producers are connected."""
        return bool(self._slots)

    async def start(self) -> None:
        """Connect every producer, once; raises (KafkaError, TimeoutError, OSError) when Kafka does not answer."""
        if self._slots:
            return
        async with self._lock:
            if self._slots:
                return
            timeout = self._settings.kafka_timeout_s
            producers = [
                create_producer(
                    self._settings,
                    client_id=f"sluicegate-ingress-{n}",
                    request_timeout_ms=max(1000, int(timeout * 1000)),
                )
                for n in range(self._settings.ingress_producers)
            ]
            try:
                await asyncio.wait_for(asyncio.gather(*(start_client(p, self._settings) for p in producers)), timeout)
            except BaseException:
                for producer in producers:
                    with contextlib.suppress(Exception):
                        await producer.stop()
                raise
            self._slots = [_Slot(producer) for producer in producers]

    @contextlib.contextmanager
    def lease(self) -> Iterator[AIOKafkaProducer]:
        """The started producer with the fewest publishes in flight, counted busy until the block ends.

        Raises ``KafkaConnectionError`` when the pool is not started (or was closed).
        """
        if not self._slots:
            raise KafkaConnectionError("the ingress producers are not started")
        slot = min(self._slots, key=lambda s: s.in_flight)
        slot.in_flight += 1
        try:
            yield slot.producer
        finally:
            slot.in_flight -= 1

    async def close(self) -> None:
        """Flush and stop the producers, if started."""
        slots, self._slots = self._slots, []
        results = await asyncio.gather(*(slot.producer.stop() for slot in slots), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
