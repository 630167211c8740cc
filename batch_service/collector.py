"""The results collector: reads the durable ``llm.results`` topic without a consumer group, keeping its own
position per partition in Redis, and stores each batch line's outcome together with the new positions in one
atomic Redis step (:meth:`BatchStore.resolve`). A crash anywhere therefore re-reads from the last stored position
and stores nothing twice. A Redis lock with a TTL keeps one collector running at a time across batch workers.
It also measures the rate batch lines finish at, which every batch's ETA divides by.
"""

from __future__ import annotations

import logging
import math
import secrets
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from schemas import FinalResult, parse_batch_request_id
from sluicegate.batches.store import LineOutcome
from sluicegate.kafka import create_consumer, ensure_topics
from sluicegate.telemetry import context_from_headers, tracer, tracing_enabled

from .locks import RedisLock
from .outcomes import outcome_of_result
from .runtime import BatchRuntime

log = logging.getLogger(__name__)

#: Records stored per atomic Redis step.
_GROUP = 500
#: Seconds over which the completion rate forgets: finishes older than a few of these barely count.
RATE_TIME_CONSTANT_S = 60.0


class Collector:
    """One process's reader of ``llm.results``; :meth:`collect` runs one pass under the collector lock."""

    def __init__(self, runtime: BatchRuntime) -> None:
        self.runtime = runtime
        self.lock = RedisLock(
            runtime.redis, runtime.names.batch_collector_lock_key, ttl_s=runtime.settings.batch_lock_ttl_s
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._partitions: list[TopicPartition] = []
        self._owner = secrets.token_hex(8)

    async def _start(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            topic = self.runtime.names.results_topic
            settings = self.runtime.settings
            counts = await ensure_topics(
                settings.kafka_bootstrap,
                {topic: settings.topic_partitions},
                settings.topic_replication,
                settings=settings,
            )
            consumer = create_consumer(group_id=None, settings=settings, client_id="sluicegate-batch-collector")
            await consumer.start()
            self._partitions = [TopicPartition(topic, p) for p in range(counts[topic])]
            consumer.assign(self._partitions)
            self._consumer = consumer
        return self._consumer

    async def close(self) -> None:
        """Stop the consumer."""
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def collect(self, budget_s: float = 1.0) -> int:
        """Read what ``llm.results`` holds past the stored positions (for at most ``budget_s``) and store the batch
        lines' outcomes; returns how many were new. Does nothing when another collector holds the lock."""
        if not await self.lock.acquire():
            return 0
        try:
            return await self._pass(budget_s)
        finally:
            await self.lock.release()

    async def _pass(self, budget_s: float) -> int:
        consumer = await self._start()
        raw_offsets = await self.runtime.redis.hgetall(self.runtime.names.batch_collector_offsets_key)
        stored = {int(p): int(o) for p, o in raw_offsets.items()}
        # Always from the stored positions: another collector may have moved them since this one last ran.
        for tp in self._partitions:
            if tp.partition in stored:
                consumer.seek(tp, stored[tp.partition])
            else:
                await consumer.seek_to_beginning(tp)
        started = time.monotonic()
        new = 0
        while time.monotonic() - started < budget_s:
            fetched = await consumer.getmany(*self._partitions, timeout_ms=100, max_records=_GROUP)
            if not any(fetched.values()):
                break
            lines: list[tuple[str, int, LineOutcome]] = []
            offsets: dict[int, int] = {}
            for tp, records in fetched.items():
                for record in records:
                    offsets[tp.partition] = record.offset + 1
                    owner = parse_batch_request_id(record.key.decode()) if record.key else None
                    if owner is None:
                        continue  # not a batch line (most results are online requests)
                    try:
                        result = FinalResult.model_validate_json(record.value)
                    except ValidationError as exc:
                        log.error("batch.collector_bad_result offset=%s error=%s", record.offset, exc)
                        continue
                    lines.append((owner[0], owner[1], outcome_of_result(result)))
                    if tracing_enabled():
                        _trace_collected(record.headers, owner[0], owner[1])
            new += (await self.runtime.resolve(lines, offsets)).total
            await self.lock.extend()
        await self._measure(new, time.monotonic() - started)
        await self._measure_lag(consumer)
        return new

    async def _measure_lag(self, consumer: AIOKafkaConsumer) -> None:
        """Records of ``llm.results`` past the positions this pass stored (the metrics' collector lag)."""
        ends = await consumer.end_offsets(self._partitions)
        raw = await self.runtime.redis.hgetall(self.runtime.names.batch_collector_offsets_key)
        stored = {int(p): int(o) for p, o in raw.items()}
        lag = sum(max(0, end - stored.get(tp.partition, 0)) for tp, end in ends.items())
        self.runtime.metrics.collector_lag.set(lag)

    async def _measure(self, new: int, elapsed_s: float) -> None:
        """Fold this pass into the completion rate: lines finished per second of time with batches active, each
        second weighted by exp(-age / RATE_TIME_CONSTANT_S). A decayed sum of lines over a decayed sum of
        seconds has no start-up bias (an average of per-pass rates had: a burst in the first pass after a quiet
        spell set the ETA of a whole batch), and time with no active batch does not dilute it."""
        key = self.runtime.names.batch_rate_key
        now = time.time()
        raw = {k.decode(): float(v) for k, v in (await self.runtime.redis.hgetall(key)).items()}
        last_at = raw.get("at")
        lines, seconds = raw.get("lines", 0.0), raw.get("seconds", 0.0)
        active = await self.runtime.redis.zcard(self.runtime.names.batches_active_key)
        if last_at is not None and now > last_at and (active or new):
            decay = math.exp(-(now - last_at) / RATE_TIME_CONSTANT_S)
            lines, seconds = lines * decay + new, seconds * decay + (now - last_at)
        rate = lines / seconds if seconds > 0 else 0.0
        await self.runtime.redis.hset(key, mapping={"at": now, "lines": lines, "seconds": seconds, "rate": rate})


def _trace_collected(headers: list[tuple[str, bytes]] | None, batch_id: str, line: int) -> None:
    """A span for a batch line's result reaching its batch, in the line's trace (the worker's result record
    carries it): the last hop of create -> task -> Kafka -> worker -> collected."""
    span = tracer("sluicegate.batch").start_span(
        "collect batch line",
        context=context_from_headers(headers),
        kind=SpanKind.CONSUMER,
        attributes={"sluicegate.batch_id": batch_id, "sluicegate.batch_line": line},
    )
    span.end()
