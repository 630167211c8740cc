"""Cancelling a request: a Redis marker (honoured even while the request is still queued in Kafka)
plus a ``CancelRequest`` on the control topic (which reaches the worker running it right away).

The Kafka producer starts on the first cancellation, so relaying streams never depends on Kafka
being reachable; if publishing fails, the marker still stops the request when a worker picks it up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import CancelRequest, Names
from schemas.names import HEADER_REQUEST_ID
from sluicegate.kafka import ensure_topics

log = logging.getLogger(__name__)

ProducerFactory = Callable[[], AIOKafkaProducer]


class Canceller:
    """Marks requests cancelled in Redis and tells the workers over Kafka."""

    def __init__(
        self,
        redis: Redis,
        names: Names,
        *,
        ttl_s: int,
        producer_factory: ProducerFactory | None = None,
        kafka_bootstrap: str | None = None,
        topic_replication: int = 1,
        publish_timeout_s: float = 10.0,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"cancel marker TTL must be >= 1 s, got {ttl_s}")
        self._redis = redis
        self._names = names
        self._ttl_s = ttl_s
        self._producer_factory = producer_factory
        # Where to create the control topic (one partition: cancellations go to every worker) before
        # the first publish; None when something else creates it.
        self._kafka_bootstrap = kafka_bootstrap
        self._topic_replication = topic_replication
        self._publish_timeout_s = publish_timeout_s
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[bool]] = set()

    async def _started_producer(self) -> AIOKafkaProducer | None:
        if self._producer_factory is None:
            return None
        async with self._lock:
            if self._producer is None:
                if self._kafka_bootstrap is not None:
                    await ensure_topics(
                        self._kafka_bootstrap,
                        {self._names.control_topic: 1},
                        self._topic_replication,
                        timeout_s=self._publish_timeout_s,
                    )
                producer = self._producer_factory()
                try:
                    await asyncio.wait_for(producer.start(), self._publish_timeout_s)
                except BaseException:
                    await producer.stop()
                    raise
                self._producer = producer
            return self._producer

    async def cancel(self, request_id: str, tenant: str, reason: str = "client_cancelled") -> bool:
        """Cancel ``request_id``; True when the control message reached Kafka as well as the marker Redis.

        Cancelling twice is harmless: workers ignore cancellations of requests they no longer hold.
        """
        message = CancelRequest(request_id=request_id, tenant=tenant, reason=reason)
        body = message.model_dump_json()
        await self._redis.set(self._names.cancel_key(request_id), body, ex=self._ttl_s)
        try:
            producer = await self._started_producer()
            if producer is None:
                return False
            await asyncio.wait_for(
                producer.send_and_wait(
                    self._names.control_topic,
                    body.encode(),
                    key=request_id.encode(),
                    headers=[(HEADER_REQUEST_ID, request_id.encode())],
                ),
                self._publish_timeout_s,
            )
        except (KafkaError, TimeoutError, OSError) as exc:
            log.error("relay.cancel_publish_failed request_id=%s error=%r", request_id, exc)
            return False
        log.info("relay.cancelled request_id=%s tenant=%s", request_id, tenant)
        return True

    async def warm_up(self) -> None:
        """Connect to Kafka ahead of the first cancellation; failure is only logged (retried on use)."""
        try:
            await self._started_producer()
        except (KafkaError, TimeoutError, OSError) as exc:
            log.warning("relay.kafka_not_ready error=%r; cancellations will retry on use", exc)

    def cancel_soon(self, request_id: str, tenant: str, reason: str = "client_cancelled") -> asyncio.Task[bool]:
        """Cancel in the background: the cancellation completes even if the client that asked leaves."""
        task = asyncio.create_task(self._cancel_logged(request_id, tenant, reason), name=f"cancel-{request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _cancel_logged(self, request_id: str, tenant: str, reason: str) -> bool:
        try:
            return await self.cancel(request_id, tenant, reason)
        except (RedisError, OSError) as exc:
            log.error("relay.cancel_failed request_id=%s error=%r", request_id, exc)
            return False

    async def aclose(self) -> None:
        """Finish cancellations under way, then stop the producer."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._publish_timeout_s)
        async with self._lock:
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None
