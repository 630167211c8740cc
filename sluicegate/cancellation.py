"""The one cancel path: a Redis cancel marker (honoured even while the request still waits in Kafka)
plus a ``CancelRequest`` on the control topic (which reaches the worker running it right away).

Used by ingress (``DELETE /v1/requests/<id>``, client disconnect, a publish it has to take back) and
by the result service (a WebSocket ``cancel``). Each service keeps its own Kafka producer handling
and hands this module only a way to lease a started producer; without one, cancelling sets the
marker alone. Workers look only at whether the marker key exists (see
``gpu_workers.worker.stream_state.read_pickup_state``); its value is for operators.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import CancelRequest, Names
from schemas.names import HEADER_REQUEST_ID

log = logging.getLogger(__name__)

#: Lends a started producer for one send (raising KafkaError, TimeoutError or OSError when it cannot).
ProducerLease = Callable[[], AbstractAsyncContextManager[AIOKafkaProducer]]


class Canceller:
    """Cancels requests: marker in Redis first (the part that must hold), then the control message."""

    def __init__(
        self,
        redis: Redis,
        names: Names,
        *,
        marker_ttl_s: int,
        service: str,
        lease: ProducerLease | None = None,
        publish_timeout_s: float = 10.0,
    ) -> None:
        if marker_ttl_s < 1:
            raise ValueError(f"cancel marker TTL must be >= 1 s, got {marker_ttl_s}")
        self._redis = redis
        self._names = names
        self._ttl_s = marker_ttl_s
        self._lease = lease
        self._publish_timeout_s = publish_timeout_s
        # Log event prefix, so an operator sees which service cancelled.
        self._service = service
        self._background: set[asyncio.Task[bool]] = set()

    async def mark(self, request_id: str, tenant: str, reason: str, *, drop: Sequence[str] = ()) -> None:
        """Set the cancel marker, deleting the ``drop`` keys in the same round trip.

        Raises ``RedisError`` / ``OSError`` when Redis does not take it.
        """
        # The marker holds the same CancelRequest the control topic carries (who, why, when); a worker at
        # pick-up only needs the key to exist.
        marker = CancelRequest(request_id=request_id, tenant=tenant, reason=reason).model_dump_json().encode()
        key = self._names.cancel_key(request_id, tenant)
        if not drop:
            await self._redis.set(key, marker, ex=self._ttl_s)
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(key, marker, ex=self._ttl_s)
            pipe.delete(*drop)
            await pipe.execute()

    async def publish(self, request_id: str, tenant: str, reason: str) -> bool:
        """Send the ``CancelRequest`` on the control topic; False (logged) when Kafka does not take it
        in time or there is no producer."""
        if self._lease is None:
            return False
        message = CancelRequest(request_id=request_id, tenant=tenant, reason=reason)
        try:
            async with self._lease() as producer:
                await asyncio.wait_for(
                    producer.send_and_wait(
                        self._names.control_topic,
                        message.model_dump_json().encode(),
                        key=request_id.encode(),
                        headers=[(HEADER_REQUEST_ID, request_id.encode())],
                    ),
                    self._publish_timeout_s,
                )
        except (KafkaError, TimeoutError, OSError) as exc:
            log.warning(
                "%s.cancel_publish_failed request_id=%s reason=%s error=%r", self._service, request_id, reason, exc
            )
            return False
        return True

    async def cancel(self, request_id: str, tenant: str, reason: str = "client_cancelled") -> bool:
        """Cancel ``request_id``; True when the control message reached Kafka as well as the marker Redis.

        Raises ``RedisError`` / ``OSError`` when the marker could not be set. The marker alone already
        stops the request at its worker's next check; the message only speeds that up. Cancelling twice
        is harmless: workers ignore cancellations of requests they no longer hold.
        """
        await self.mark(request_id, tenant, reason)
        published = await self.publish(request_id, tenant, reason)
        log.info(
            "%s.cancelled request_id=%s tenant=%s reason=%s published=%s",
            self._service,
            request_id,
            tenant,
            reason,
            published,
        )
        return published

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
            log.error("%s.cancel_failed request_id=%s error=%r", self._service, request_id, exc)
            return False

    async def aclose(self) -> None:
        """Wait (bounded) for background cancellations under way; the producer belongs to the caller."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._publish_timeout_s)
