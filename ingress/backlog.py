"""Admission control: a bound on each model's backlog, so a burst queues in Kafka only up to a point and then
gets 429 + ``Retry-After`` instead of an ever longer wait.

The backlog is read from Kafka, where it lives. Workers commit an offset only once every request below it has
finished, so a request topic's consumer lag for the model's worker group (end offset minus committed offset;
from the log start where the group has committed nothing yet) counts every request accepted and not yet
finished: unread ones, those waiting in an engine (the heartbeats' ``waiting``) and those running. Subtracting
the heartbeats' ``running`` leaves the requests accepted but not started. Workers drain higher tiers first, so
running requests are taken off the highest tiers first, and a request is compared with the backlog at or above
its own tier: a large batch queue does not turn interactive traffic away.

One estimate per model is reused for ``backlog_cache_s`` and refreshed in the background, so the request path
pays no Kafka round trip; requests this process accepted since the last read are added to it, so a burst
within one refresh interval cannot overshoot the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas import TIERS, Names, Tier, WorkerHeartbeat, tier_rank
from sluicegate.api.errors import ApiError
from sluicegate.kafka import create_admin, create_consumer, start_client
from sluicegate.settings import IngressSettings
from sluicegate.task_stop import cancel_and_wait

from .telemetry import IngressMetrics

log = logging.getLogger(__name__)

# After a failed first read, requests for the model are admitted without waiting on Kafka for this long.
_FAILED_READ_BACKOFF_S = 5.0


def backlog_ahead(lags: Mapping[str, int], running: int, tier: Tier) -> int:
    """Requests not started at or above ``tier``, given each tier's unfinished count (``lags``) and how many
    requests the model's workers are running. Running requests come off the highest tiers first."""
    left = max(0, running)
    ahead = 0
    for each in TIERS:
        count = max(0, lags.get(each, 0))
        taken = min(left, count)
        left -= taken
        if tier_rank(each) <= tier_rank(tier):
            ahead += count - taken
    return ahead


@dataclass
class _Estimate:
    read_at: float
    lags: dict[str, int]
    # The end offsets ``lags`` was computed from: a record below them is already counted.
    ends: dict[TopicPartition, int] = field(default_factory=dict)
    # Records this process published that the last read did not cover yet: (tier, partition, offset).
    pending: list[tuple[Tier, TopicPartition, int]] = field(default_factory=list)

    def current(self) -> dict[str, int]:
        counts = dict(self.lags)
        for tier, _, _ in self.pending:
            counts[tier] = counts.get(tier, 0) + 1
        return {tier: counts.get(tier, 0) for tier in TIERS}


class BacklogMonitor:
    """Per-model backlog estimates from Kafka, and the 429 when a request would exceed the bound."""

    def __init__(self, settings: IngressSettings, names: Names, metrics: IngressMetrics) -> None:
        self._settings = settings
        self._names = names
        self._metrics = metrics
        self._timeout_s = settings.kafka_timeout_s
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._clients_lock = asyncio.Lock()
        self._coordinators: dict[str, int] = {}
        self._estimates: dict[str, _Estimate] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        """False when ``max_backlog_per_model`` is 0."""
        return self._settings.max_backlog_per_model > 0

    async def close(self) -> None:
        """Stop refreshes and Kafka clients."""
        await cancel_and_wait(*self._refreshing.values())
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
        if self._admin is not None:
            with contextlib.suppress(Exception):
                await self._admin.close()
        self._consumer = self._admin = None

    # --- the request path -------------------------------------------------------------------------------------
    async def admit(
        self, model: str, tier: Tier, heartbeats: Sequence[WorkerHeartbeat], partitions: Mapping[str, int]
    ) -> None:
        """Raise a 429 when the backlog at or above ``tier`` is at the bound. ``partitions`` gives each of the
        model's request topics' partition count. A model whose backlog cannot be read (Kafka does not answer)
        is admitted: publishing then reports Kafka's state."""
        bound = self._settings.max_backlog_per_model
        if bound <= 0:
            return
        estimate = self._estimates.get(model)
        now = time.monotonic()
        if estimate is None:
            if now - self._failed_at.get(model, -_FAILED_READ_BACKOFF_S) >= _FAILED_READ_BACKOFF_S:
                # A failed read is logged by _refresh; the request goes on unbounded rather than failing.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._refresh_task(model, partitions))
            estimate = self._estimates.get(model)
            if estimate is None:
                return
        elif now - estimate.read_at >= self._settings.backlog_cache_s:
            self._refresh_task(model, partitions)
        running = sum(beat.running for beat in heartbeats)
        ahead = backlog_ahead(estimate.current(), running, tier)
        if ahead >= bound:
            self._metrics.rejected.labels("backlog_full").inc()
            retry_after = self._settings.backlog_retry_after_s
            raise ApiError(
                429,
                f"Model '{model}' has {ahead} requests waiting at or above the '{tier}' tier, at its bound of "
                f"{bound}; nothing was queued. Retry after {retry_after} s.",
                code="model_backlog_full",
                headers={"Retry-After": str(retry_after)},
            )

    def accepted(self, model: str, tier: Tier, topic: str, partition: int, offset: int) -> None:
        """Count a record published for ``model`` until a read's end offsets cover it."""
        estimate = self._estimates.get(model)
        tp = TopicPartition(topic, partition)
        # The acknowledgement can reach us after a refresh already read past this record.
        if estimate is not None and offset >= estimate.ends.get(tp, 0):
            estimate.pending.append((tier, tp, offset))

    def estimate(self, model: str) -> dict[str, int] | None:
        """The current estimate per tier (unfinished requests, running ones included), or None before a read."""
        found = self._estimates.get(model)
        return found.current() if found is not None else None

    # --- reading Kafka ----------------------------------------------------------------------------------------
    def _refresh_task(self, model: str, partitions: Mapping[str, int]) -> asyncio.Task[None]:
        task = self._refreshing.get(model)
        if task is None or task.done():
            task = asyncio.create_task(self._refresh(model, dict(partitions)), name=f"backlog:{model}")
            self._refreshing[model] = task
            task.add_done_callback(self._settle)
        return task

    def _settle(self, task: asyncio.Task[None]) -> None:
        # Read the outcome so a failed background refresh is not reported as "never retrieved"; _refresh has
        # logged it already.
        if not task.cancelled():
            task.exception()

    async def _refresh(self, model: str, partitions: dict[str, int]) -> None:
        started = time.monotonic()
        try:
            lags, ends = await asyncio.wait_for(self._read(model, partitions), self._timeout_s)
        except Exception as exc:
            # An estimate is best effort: any failure (Kafka down, coordinator moving, a client error) keeps the
            # last estimate, and the next refresh starts from a fresh coordinator lookup.
            self._failed_at[model] = time.monotonic()
            self._coordinators.pop(self._names.worker_group(model), None)
            log.warning("ingress.backlog_read_failed model=%s error=%r", model, exc)
            await self._drop_clients()
            raise
        current = self._estimates.get(model)
        # A record published while the read ran is in it exactly when its offset is below the end offset read,
        # so nothing is counted twice (which would refuse early) or missed (which would overshoot the bound).
        pending = current.pending if current is not None else []
        leftover = [(t, tp, off) for t, tp, off in pending if off >= ends.get(tp, 0)]
        self._estimates[model] = _Estimate(started, lags, ends, leftover)
        self._failed_at.pop(model, None)
        self._metrics.backlog.labels(model).set(sum(lags.values()))

    async def _drop_clients(self) -> None:
        """Close the Kafka clients so the next read starts new ones (a broker that came back on another
        address, or a client stuck on a dead connection, is not reused)."""
        async with self._clients_lock:
            admin, consumer = self._admin, self._consumer
            self._admin = self._consumer = None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), self._timeout_s)
        if admin is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), self._timeout_s)

    async def _clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        async with self._clients_lock:
            timeout_ms = max(1000, int(self._timeout_s * 1000))
            if self._admin is None:
                admin = create_admin(
                    self._settings, client_id="sluicegate-ingress-backlog", request_timeout_ms=timeout_ms
                )
                try:
                    await start_client(admin, self._settings)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await admin.close()
                    raise
                self._admin = admin
            if self._consumer is None:
                # No group: this consumer only asks for log start and end offsets.
                consumer = create_consumer(
                    group_id=None,
                    settings=self._settings,
                    client_id="sluicegate-ingress-backlog",
                    request_timeout_ms=timeout_ms,
                )
                try:
                    await consumer.start()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await consumer.stop()
                    raise
                self._consumer = consumer
            return self._admin, self._consumer

    async def _read(
        self, model: str, partitions: Mapping[str, int]
    ) -> tuple[dict[str, int], dict[TopicPartition, int]]:
        """Unfinished requests per tier (the worker group's lag on the model's request topics) and the end
        offsets the lag was computed from."""
        admin, consumer = await self._clients()
        tiers = {self._names.request_topic(model, tier): tier for tier in TIERS}
        tps = [TopicPartition(topic, p) for topic in tiers for p in range(partitions.get(topic, 0))]
        if not tps:
            return dict.fromkeys(TIERS, 0), {}
        group = self._names.worker_group(model)
        coordinator = self._coordinators.get(group)
        if coordinator is None:
            coordinator = self._coordinators[group] = await admin.find_coordinator(group)
        committed, starts, ends = await asyncio.gather(
            admin.list_consumer_group_offsets(group, group_coordinator_id=coordinator, partitions=tps),
            consumer.beginning_offsets(tps),
            consumer.end_offsets(tps),
        )
        lags = dict.fromkeys(TIERS, 0)
        for tp in tps:
            start, end = starts[tp], ends[tp]
            mark = committed.get(tp)
            # A group that never committed on a partition starts at its log start (auto_offset_reset=earliest).
            position = max(start, mark.offset) if mark is not None and mark.offset >= 0 else start
            lags[tiers[tp.topic]] += max(0, end - position)
        return lags, dict(ends)
