"""Taking requests from Kafka: the fetch loop over the tier topics, each tier's room, admitting records,
hand-off on rebalance, and offset commits.

A tier's partitions are paused once it has no room (:mod:`.tier_rooms`: ``max_in_flight`` requests of that tier
or above, and the batch tier's yielding to interactive traffic), so the backlog stays in Kafka; an offset is
committed only when every request at or below it reached an outcome (:mod:`.offsets`). What one fetch brings is
admitted tier by tier and, inside a tier, earliest deadline first (records without one after, in fetch order), the
order the engine's waiting queue keeps too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, InvalidSessionTimeoutError, KafkaError

from gpu_workers.engine import EngineFront
from schemas import TIERS, InferenceRequest, Names
from schemas.names import Tier
from sluicegate.dead_letters import Rejection, validate_record

from .config import WorkerConfig
from .in_flight import Active, InFlight
from .observer import WorkerObserver
from .offsets import CompletionWatermarks
from .outputs import Outputs
from .serving import Serving
from .telemetry import WorkerTelemetry
from .tier_rooms import TierRooms

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, intake: Intake) -> None:
        self._intake = intake

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._intake.hand_off(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info(
            "worker.partitions_assigned",
            extra={"partitions": sorted(f"{p.topic}:{p.partition}" for p in assigned)},
        )


class Intake:
    """The group consumer's side of the worker: what is fetched, admitted, handed off and committed."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        engine: EngineFront,
        config: WorkerConfig,
        names: Names,
        in_flight: InFlight,
        serving: Serving,
        outputs: Outputs,
        stopping: asyncio.Event,
        observer: WorkerObserver | None = None,
    ) -> None:
        self.consumer = consumer
        self._observer = observer
        self.engine = engine
        self.config = config
        self.in_flight = in_flight
        self.serving = serving
        self.outputs = outputs
        self.stopping = stopping
        self.watermarks: CompletionWatermarks[TopicPartition] = CompletionWatermarks()
        self._tiers: dict[str, Tier] = {names.request_topic(config.model_name, t): t for t in TIERS}
        self.rooms = TierRooms(config)
        self._room = asyncio.Event()
        self._commit_task: asyncio.Task[None] | None = None
        self.joined = False  # the group consumer has joined (readiness)
        self.telemetry: WorkerTelemetry | None = None  # set by the Worker

    @property
    def topics(self) -> list[str]:
        return list(self._tiers)

    def rebalance_listener(self) -> ConsumerRebalanceListener:
        return _Rebalance(self)

    # --- fetching ----------------------------------------------------------------------------------
    async def run(self, start_consumer: bool = False) -> None:
        """Fetch and admit records until the worker stops (see :meth:`Worker.run <.worker.Worker.run>` for
        ``start_consumer``)."""
        if start_consumer:
            try:
                await self.consumer.start()
            except InvalidSessionTimeoutError as exc:
                raise RuntimeError(
                    f"the Kafka broker refuses a consumer session timeout of {self.config.session_timeout_ms} ms; set "
                    "SLUICEGATE_WORKER_SESSION_TIMEOUT_MS within its group.min.session.timeout.ms and "
                    "group.max.session.timeout.ms"
                ) from exc
            self.joined = True
            log.info("worker.joined_group", extra={"partitions": len(self.consumer.assignment())})
        while not self.stopping.is_set():
            fatal = self.serving.fatal
            if fatal is not None:
                raise RuntimeError(f"the engine failed; stopping this worker: {fatal!r}") from fatal
            assigned = self.consumer.assignment()
            rooms = self._rooms()
            open_tps = [tp for tp in assigned if rooms[self._tier_of(tp)] > 0]
            full_tps = [tp for tp in assigned if rooms[self._tier_of(tp)] <= 0]
            # Paused, a full tier's partitions are not fetched: a fetched response left unconsumed would
            # hold back the broker's next fetch (aiokafka's prefetch backoff), and with it interactive requests.
            if full_tps:
                self.consumer.pause(*full_tps)
            if not open_tps:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), self._wait_s(0.2))
                continue
            self.consumer.resume(*open_tps)
            for record, parsed in self._by_deadline(await self._fetch_by_tier(open_tps, rooms)):
                self._admit(record, parsed)

    def pause(self) -> None:
        """Fetch nothing more (the worker is draining)."""
        with contextlib.suppress(Exception):
            self.consumer.pause(*self.consumer.assignment())

    def _tier_of(self, tp: TopicPartition) -> Tier:
        return self._tiers.get(tp.topic, "batch")

    def _rooms(self) -> dict[Tier, int]:
        """How many more requests each tier may take now (:class:`.tier_rooms.TierRooms`)."""
        held = dict.fromkeys(TIERS, 0)
        awaiting: list[tuple[Tier, float]] = []
        for entry in self.in_flight:
            held[entry.tier] += 1
            if not entry.produced:
                awaiting.append((entry.tier, entry.taken_at))
        return self.rooms.rooms(held, awaiting)

    def _wait_s(self, longest: float) -> float:
        """How long to wait for records (or room): ``longest``, or less when the batch tier's pace frees it sooner."""
        paced = self.rooms.paced_wait_s()
        return longest if paced is None else min(longest, paced)

    async def _fetch_by_tier(self, open_tps: list[TopicPartition], rooms: dict[Tier, int]) -> list[Any]:
        """Records already fetched for the highest non-empty tier; else wait briefly for any (no tier gets
        more than its room, as taking a request leaves less room for its tier and those below)."""
        by_tier: dict[Tier, list[TopicPartition]] = {t: [] for t in TIERS}
        for tp in open_tps:
            by_tier[self._tier_of(tp)].append(tp)
        for tier in TIERS:
            if by_tier[tier]:
                batch = await self.consumer.getmany(*by_tier[tier], timeout_ms=0, max_records=rooms[tier])
                if batch:
                    return [r for records in batch.values() for r in records]
        most = min(rooms[t] for t in by_tier if by_tier[t])
        batch = await self.consumer.getmany(*open_tps, timeout_ms=round(1000 * self._wait_s(0.1)), max_records=most)
        return [r for records in batch.values() for r in records]  # put in tier order by ``_by_deadline``

    def _by_deadline(self, records: list[Any]) -> list[tuple[Any, InferenceRequest | Rejection | Exception]]:
        """The fetched records, parsed, in admission order: by tier, then earliest deadline first (the sort is
        stable, so records without a deadline, or that failed to parse, keep their fetch order after those)."""
        parsed: list[tuple[Any, InferenceRequest | Rejection | Exception]] = []
        for record in records:
            try:
                # No deadline check here: it is about starting, which only the request's stream can tell.
                parsed.append((record, validate_record(record.value, record.headers, check_deadline=False)))
            except Exception as exc:  # reported by the request's task, like any failure to serve it
                parsed.append((record, exc))

        def order(item: tuple[Any, InferenceRequest | Rejection | Exception]) -> tuple[int, float]:
            record, request = item
            deadline = request.deadline_epoch() if isinstance(request, InferenceRequest) else None
            return TIERS.index(self._tiers.get(record.topic, "batch")), math.inf if deadline is None else deadline

        parsed.sort(key=order)
        return parsed

    def _admit(self, record: Any, parsed: InferenceRequest | Rejection | Exception) -> None:
        if self._observer is not None:
            self._observer.record_taken(record)
        if self.telemetry is not None:
            self.telemetry.record_taken(record)
        tp = TopicPartition(record.topic, record.partition)
        self.watermarks.started(tp, record.offset)
        tier = self._tier_of(tp)
        self.rooms.taken(tier)
        entry = self.in_flight.take(tp, record.offset, tier)
        if isinstance(parsed, InferenceRequest) and self.in_flight.claim_at_once(entry, parsed.request_id):
            # The engine starts here rather than in the request's task: that task runs only after the fetch loop
            # and the consumer's next fetch have had the event loop.
            try:
                entry.early = self.serving.start_early(parsed, entry)
            except Exception:  # the task meets the same failure again and reports it there
                entry.early = None
        entry.task = asyncio.create_task(self._serve(tp, record, entry, parsed), name=entry.provisional_key)

    async def _serve(
        self, tp: TopicPartition, record: Any, entry: Active, parsed: InferenceRequest | Rejection | Exception
    ) -> None:
        # Only a request that reached an outcome lets its offset be committed; anything else is re-delivered
        # to the partition's next owner.
        completed = False
        try:
            completed = await self.serving.serve(record, entry, parsed)
        finally:
            if completed and not entry.handed_off:
                self.watermarks.finished(tp, record.offset)
                self._schedule_commit()
            self._room.set()

    # --- commits and hand-off ----------------------------------------------------------------------
    def _schedule_commit(self) -> None:
        """Commit soon, once for all requests finishing within ``commit_interval_s``: a commit per request
        costs the broker and this event loop a round trip each, on the machine that serves first tokens."""
        if self._commit_task is None or self._commit_task.done():
            self._commit_task = asyncio.create_task(self._commit_later(), name="worker-commit")

    async def _commit_later(self) -> None:
        await asyncio.sleep(self.config.commit_interval_s)
        await self.commit()

    async def commit(self) -> None:
        """Commit every partition's watermark that moved (only partitions still assigned here)."""
        assigned = self.consumer.assignment()
        offsets = {tp: off for tp, off in self.watermarks.to_commit().items() if tp in assigned}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.watermarks.mark_committed(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance is under way; the new owner re-reads from the last commit, and the
            # stream's explicit ids make the replayed appends harmless.
            log.warning("worker.commit_failed", extra={"error": repr(exc)})

    async def final_commit(self) -> None:
        """The last commit of a draining worker, in place of any scheduled one."""
        if self._commit_task is not None:
            self._commit_task.cancel()
            await asyncio.gather(self._commit_task, return_exceptions=True)
        await self.commit()

    async def hand_off(self, revoked: set[TopicPartition]) -> None:
        """Partitions are being taken away: stop their requests, persist, commit, forget them."""
        moving = [entry for entry in self.in_flight if entry.partition in revoked]
        for entry in moving:
            entry.handed_off = True
            for engine_id in entry.engine_request_ids:
                with contextlib.suppress(Exception):
                    await self.engine.abort(engine_id)
        await self.outputs.flush()
        await self.commit()
        for tp in revoked:
            self.watermarks.forget(tp)
        if moving:
            log.info("worker.handed_off", extra={"requests": len(moving)})
