"""Publishing a routed request: Kafka headers, and creating each model's request topics once.

Shared by ingress (in-process routing) and the router stream processor so both put the same record on
the same topic.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from schemas import InferenceRequest, Names
from schemas.names import HEADER_REQUEST_ID, HEADER_TRACEPARENT, HEADER_TRACESTATE
from sluicegate.kafka import ensure_topics
from sluicegate.settings import KafkaSettings
from sluicegate.telemetry import kafka_injects_trace

from .router import Route, Router

log = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]


def request_headers(request: InferenceRequest, trace: Mapping[str, str] | None = None) -> Headers:
    """``request_id`` plus W3C trace context: from ``trace`` (a propagator carrier) when it has one,
    else from the request's own ``trace`` field. While tracing is on, the aiokafka instrumentation injects the
    producer span's context itself, so none is added here (a record carries one ``traceparent``)."""
    headers: Headers = [(HEADER_REQUEST_ID, request.request_id.encode())]
    if kafka_injects_trace():
        return headers
    traceparent = (trace or {}).get(HEADER_TRACEPARENT)
    tracestate = (trace or {}).get(HEADER_TRACESTATE)
    if traceparent is None and request.trace is not None:
        traceparent, tracestate = request.trace.traceparent, request.trace.tracestate
    if traceparent:
        headers.append((HEADER_TRACEPARENT, traceparent.encode()))
    if tracestate:
        headers.append((HEADER_TRACESTATE, tracestate.encode()))
    return headers


class TopicRegistry:
    """Creates a model's three request topics the first time the model is seen, and tells the router
    how many partitions each really has. Concurrent first requests for one model share one creation."""

    def __init__(
        self,
        kafka: KafkaSettings,
        names: Names,
        router: Router,
        *,
        partitions: int,
        replication: int,
        timeout_s: float,
    ) -> None:
        self._kafka = kafka  # where the topics are created, and with which security
        self._names = names
        self._router = router
        self._partitions = partitions
        self._replication = replication
        self._timeout_s = timeout_s
        self._ready: set[str] = set()
        self._pending: dict[str, asyncio.Task[None]] = {}

    async def ensure_model(self, model: str) -> None:
        """Create (if needed) ``model``'s request topics; raises on Kafka errors or after ``timeout_s``."""
        if model in self._ready:
            return
        task = self._pending.get(model)
        if task is None:
            task = asyncio.create_task(self._create(model))
            self._pending[model] = task
            task.add_done_callback(self._forget)
        await asyncio.shield(task)

    def _forget(self, task: asyncio.Task[None]) -> None:
        # A failed creation is retried by the next request; reading the exception here keeps asyncio from
        # reporting it as never retrieved when every waiter was cancelled.
        for model, pending in list(self._pending.items()):
            if pending is task:
                del self._pending[model]
        if not task.cancelled():
            task.exception()

    async def ensure(self, topics: Mapping[str, int]) -> dict[str, int]:
        """Create arbitrary topics (DLQ, control...) with a bounded wait."""
        return await asyncio.wait_for(
            ensure_topics(
                self._kafka.kafka_bootstrap, topics, self._replication, timeout_s=self._timeout_s, settings=self._kafka
            ),
            self._timeout_s,
        )

    async def _create(self, model: str) -> None:
        counts = await self.ensure({topic: self._partitions for topic in self._names.request_topics(model)})
        for topic, count in counts.items():
            self._router.set_partitions(topic, count)
        self._ready.add(model)


async def send_routed(
    producer: AIOKafkaProducer,
    request: InferenceRequest,
    route: Route,
    headers: Headers,
    *,
    value: bytes | None = None,
) -> asyncio.Future[RecordMetadata]:
    """Hand the record to the producer; the returned future resolves once every in-sync replica has it."""
    return await producer.send(
        route.topic,
        value=value if value is not None else request.model_dump_json().encode(),
        key=route.key,
        partition=route.partition,
        headers=headers,
    )
