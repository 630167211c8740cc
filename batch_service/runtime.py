"""What one batch-worker process keeps between tasks: its own event loop (Celery tasks are plain functions;
each runs its coroutine on this loop), one Redis client, one idempotent Kafka producer, the router, the cancel
path, the stores, and the collector's results consumer. Made on first use in the process that runs the tasks
(after a prefork pool's fork, never before).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from redis.asyncio import Redis

from router.publish import TopicRegistry
from router.route_table import RouteTable
from router.router import Router
from sluicegate.api.prompt_tokens import ModelTokenizers
from sluicegate.batches.files import FileStore
from sluicegate.batches.store import BatchStore, LineOutcome, Resolved
from sluicegate.cancellation import Canceller
from sluicegate.kafka import create_producer
from sluicegate.redis_client import create_redis
from sluicegate.settings import BatchServiceSettings
from sluicegate.usage.quota import Quotas

from .metrics import BatchMetrics

T = TypeVar("T")


class BatchRuntime:
    """The clients one batch-worker process shares across tasks."""

    def __init__(self, settings: BatchServiceSettings, metrics: BatchMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or BatchMetrics()
        self.names = settings.names
        self.redis: Redis = create_redis(settings, socket_timeout=10.0, client_name="batch-worker")
        self.files = FileStore(settings, self.redis, self.names)
        self.batches = BatchStore(settings, self.redis, self.names)
        self.quotas = Quotas(self.redis, self.names)  # lines' token quotas, reserved as they are published
        # The workers' tokenizers: a line's prompt counted exactly for its quota reservation, as ingress counts.
        self.tokenizers = ModelTokenizers(self.redis, self.names)
        self.router = Router.from_settings(settings)
        # Batch lines naming a route go where ingress would send them (same file, fast path, rollbacks).
        self.routes = RouteTable(
            settings.routes_file, check_every_s=settings.routes_reload_s, redis=self.redis, names=self.names
        )
        self.topics = TopicRegistry(
            settings,
            self.names,
            self.router,
            partitions=settings.topic_partitions,
            replication=settings.topic_replication,
            timeout_s=max(settings.kafka_timeout_s, 10.0),
        )
        self._producer: AIOKafkaProducer | None = None
        self._control_ready = False
        self.canceller = Canceller(
            self.redis,
            self.names,
            marker_ttl_s=settings.request_record_ttl_s,
            lease=self._control_producer,
            publish_timeout_s=settings.kafka_timeout_s,
            service="batch",
        )
        # Made by the collector on first use (it owns the consumer's positions).
        self.collector: Any = None

    async def resolve(
        self, lines: list[tuple[str, int, LineOutcome]], offsets: dict[int, int] | None = None
    ) -> Resolved:
        """Store lines' outcomes (:meth:`BatchStore.resolve`) and count the new ones in the metrics."""
        resolved = await self.batches.resolve(lines, offsets)
        self.metrics.count_finished(resolved.completed, resolved.failed)
        return resolved

    async def producer(self) -> AIOKafkaProducer:
        """The started producer (acks=all, idempotent)."""
        if self._producer is None:
            producer = create_producer(self.settings, client_id="sluicegate-batch")
            await producer.start()
            self._producer = producer
        return self._producer

    @contextlib.asynccontextmanager
    async def _control_producer(self) -> AsyncIterator[AIOKafkaProducer]:
        producer = await self.producer()
        if not self._control_ready:
            await self.topics.ensure({self.names.control_topic: 1})
            self._control_ready = True
        yield producer

    async def close(self) -> None:
        """Release every client."""
        if self.collector is not None:
            await self.collector.close()
        if self._producer is not None:
            await self._producer.stop()
        await self.redis.aclose()


class Runner:
    """One event loop per process and the runtime living on it; ``run`` executes a task's coroutine."""

    def __init__(self, settings: BatchServiceSettings, metrics: BatchMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or BatchMetrics()
        self.loop = asyncio.new_event_loop()
        self.runtime: BatchRuntime | None = None

    def run(self, coro_fn: Any, *args: Any) -> Any:
        """Run ``coro_fn(runtime, *args)`` to completion on the process's loop."""

        async def main() -> Any:
            if self.runtime is None:
                self.runtime = BatchRuntime(self.settings, self.metrics)
            return await coro_fn(self.runtime, *args)

        return self.loop.run_until_complete(main())

    def run_coroutine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an arbitrary coroutine on the process's loop."""
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        """Close the runtime and the loop (worker shutdown)."""
        if self.loop.is_closed():
            return
        if self.runtime is not None:
            self.loop.run_until_complete(self.runtime.close())
            self.runtime = None
        self.loop.close()
