"""Taking requests from Kafka: the fetch loop over the tier topics, holding what is fetched, starting it fairly in
each tier's room, hand-off on rebalance, and offset commits.

Fetching and starting are apart. A tier's records are fetched while fewer than ``intake_hold`` of them are held
(fetched, not started), and its partitions paused once that many are, so the rest of the backlog stays in Kafka.
Held records start in the tier's room (:mod:`.tier_limits`: ``max_in_flight`` requests of that tier or above, and
the batch tier's yielding to interactive traffic), in the order :mod:`.fair_intake` gives: earliest deadline
first, then tenant by tenant by tokens. An offset is committed only when every request at or below it reached an
outcome (:mod:`.offsets`); a held record counts as unfinished from its fetch, so one never started is re-delivered.

Why hold records at all: Kafka gives a partition's records in order. Started in that order, a tenant whose
backlog of long prompts sits ahead of another's would fill every seat the worker has, and the other tenant's
records would wait in Kafka behind the whole backlog; the engine's per-tenant fairness only orders what the worker
holds. Fetching past what runs lets the worker see the other tenant's records and start them first by tokens.
Why a bound in all, not per tenant: a per-tenant bound could only be kept by pausing a partition, which stops
every tenant's records behind the one over its bound - the crowding out this is about. So the bound is a window
past what runs (``intake_hold``), and inside it the tenants share by tokens; a backlog longer than the window is
served in Kafka order until the window reaches past it (docs/benchmarks.md measures what that gives).
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
from sluicegate.api.limits import request_token_cost
from sluicegate.record_check import Rejection, validate_record
from sluicegate.task_stop import cancel_and_wait

from .config import WorkerConfig
from .fair_intake import FairIntake, Held
from .in_flight import Active, InFlight
from .observer import WorkerObserver
from .offsets import CompletionWatermarks
from .outputs import Outputs
from .serving import Serving
from .telemetry import WorkerTelemetry
from .tier_limits import TierLimits

log = logging.getLogger(__name__)

Parsed = InferenceRequest | Rejection | Exception
#: What a held record is kept as: the record and what parsing it gave.
Record = tuple[Any, Parsed]
#: The tenant a record that failed to parse is held under (no real tenant name has a NUL): it costs nothing and
#: goes first (it only becomes a dead letter or an error).
_UNPARSED = "\x00unparsed"


def start_cost(request: InferenceRequest) -> int:
    """Tokens a request's start is charged before it runs (:func:`request_token_cost`); settled to what it used
    once it finishes."""
    return request_token_cost(request)


class _Rebalance(ConsumerRebalanceListener):
    """aiokafka's eager protocol revokes every partition before each rebalance and then assigns. Requests go on
    through it (a stale owner can no longer corrupt a stream: :mod:`.fencing`): at revoke the finished offsets are
    committed, and only the requests of partitions the assignment then gives to another member are handed off."""

    def __init__(self, intake: Intake) -> None:
        self._intake = intake
        self._revoked: set[TopicPartition] = set()

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self._revoked = set(revoked)
        await self._intake.commit()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        kept = self._revoked & set(assigned)
        await self._intake.hand_off(self._revoked - kept)
        self._intake.owned_anew(set(assigned) - kept)
        self._revoked = set()
        log.info(
            "worker.partitions_assigned",
            extra={
                "partitions": sorted(f"{p.topic}:{p.partition}" for p in assigned),
                "kept": len(kept),
            },
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
        self.rooms = TierLimits(config)
        self.held: FairIntake[Record] = FairIntake(config.tenant_weights)  # fetched, not started
        self._room = asyncio.Event()
        self._commit_task: asyncio.Task[None] | None = None
        self._commit_wanted = False  # a request finished since the scheduled commit took its offsets
        self.joined = False  # the group consumer has joined (readiness)
        # Per partition, how many times it was assigned here anew (not kept through a rebalance): a fenced request
        # is retaken only while its partition stayed here (see ``_retake_later``).
        self._owned: dict[TopicPartition, int] = {}
        self._retakes: set[asyncio.Task[None]] = set()
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
            self._room.clear()  # before the rooms are read: a request finishing from here on sets it again
            starts_wait = self._start_held()
            assigned = self.consumer.assignment()
            space = {tier: self.config.intake_hold - self.held.held(tier) for tier in TIERS}
            open_tps = [tp for tp in assigned if space[self._tier_of(tp)] > 0]
            full_tps = [tp for tp in assigned if space[self._tier_of(tp)] <= 0]
            # Paused, a tier holding all it may is not fetched: a fetched response left unconsumed would
            # hold back the broker's next fetch (aiokafka's prefetch backoff), and with it interactive requests.
            if full_tps:
                self.consumer.pause(*full_tps)
            if not open_tps:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), self._wait_s(0.2))
                continue
            self.consumer.resume(*open_tps)
            fetched = await self._fetch_by_tier(open_tps, space, starts_wait)
            for record in fetched:
                self._hold(record)
            if fetched:
                # A fetch of buffered records returns without suspending: let the requests' tasks (their outputs)
                # run between chunks, rather than parse a whole hold in one go.
                await asyncio.sleep(0)

    def pause(self) -> None:
        """Fetch nothing more (the worker is draining)."""
        with contextlib.suppress(Exception):
            self.consumer.pause(*self.consumer.assignment())

    def _tier_of(self, tp: TopicPartition) -> Tier:
        return self._tiers.get(tp.topic, "batch")

    def _rooms(self) -> dict[Tier, int]:
        """How many more requests each tier may take now (:class:`.tier_limits.TierLimits`)."""
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

    async def _fetch_by_tier(
        self, open_tps: list[TopicPartition], space: dict[Tier, int], starts_wait: bool
    ) -> list[Any]:
        """Records already fetched for the highest non-empty tier; else wait briefly for any (no tier gets more
        than it may still hold). While held records wait for room, a request finishing ends the wait at once."""
        by_tier: dict[Tier, list[TopicPartition]] = {t: [] for t in TIERS}
        for tp in open_tps:
            by_tier[self._tier_of(tp)].append(tp)
        # At most a lookahead a fetch: each record is parsed on this loop, which must not stall for a whole hold.
        chunk = {tier: min(space[tier], self.config.max_in_flight) for tier in TIERS}
        for tier in TIERS:
            if by_tier[tier]:
                batch = await self.consumer.getmany(*by_tier[tier], timeout_ms=0, max_records=chunk[tier])
                if batch:
                    return [r for records in batch.values() for r in records]
        most = min(chunk[t] for t in by_tier if by_tier[t])
        timeout_ms = round(1000 * self._wait_s(0.1))
        if not starts_wait:
            batch = await self.consumer.getmany(*open_tps, timeout_ms=timeout_ms, max_records=most)
            return [r for records in batch.values() for r in records]
        fetch = asyncio.ensure_future(self.consumer.getmany(*open_tps, timeout_ms=timeout_ms, max_records=most))
        room = asyncio.ensure_future(self._room.wait())
        try:
            await asyncio.wait({fetch, room}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            room.cancel()
            if not fetch.done():
                # Safe: aiokafka takes fetched records out of its buffer only once its wait is over, so none is lost.
                fetch.cancel()
            await asyncio.wait({fetch})
        if fetch.cancelled():
            return []
        return [r for records in fetch.result().values() for r in records]

    # --- holding and starting ----------------------------------------------------------------------------------
    def _hold(self, record: Any, again: bool = False) -> None:
        """Parse a fetched record and hold it until its tier has room and :class:`.fair_intake.FairIntake` picks
        it; its offset counts as unfinished from now on. A record held or running here already is skipped: a
        partition kept through a rebalance is fetched again from its committed offset. ``again``: a fenced request
        retaken (its offset never stopped counting)."""
        tp = TopicPartition(record.topic, record.partition)
        if not again and self.watermarks.holds(tp, record.offset):
            return
        self.watermarks.started(tp, record.offset)
        parsed: Parsed
        try:
            # No deadline check here: it is about starting, which only the request's stream can tell.
            parsed = validate_record(record.value, record.headers, check_deadline=False)
        except Exception as exc:  # reported by the request's task, like any failure to serve it
            parsed = exc
        tier = self._tier_of(tp)
        if isinstance(parsed, InferenceRequest):
            self.held.push(tier, (record, parsed), parsed.tenant, start_cost(parsed), parsed.deadline_epoch())
        else:
            self.held.push(tier, (record, parsed), _UNPARSED, 0, -math.inf)

    def _start_held(self) -> bool:
        """Start held records while their tier has room, the most important tier first; True when some are left
        waiting for room."""
        left = False
        for tier in TIERS:
            while self.held.held(tier):
                if self._rooms()[tier] <= 0:
                    left = True
                    break
                held = self.held.pop(tier)
                assert held is not None
                self._admit(held)
        return left

    def held_by_tier(self) -> dict[Tier, int]:
        """Records fetched and not started, per tier (they count in the backlog, like the lag in Kafka)."""
        return {tier: self.held.held(tier) for tier in TIERS}

    def _admit(self, held: Held[Record]) -> None:
        record, parsed = held.item
        if self._observer is not None:
            self._observer.record_taken(record)
        if self.telemetry is not None:
            self.telemetry.record_taken(record)
        tp = TopicPartition(record.topic, record.partition)
        tier = self._tier_of(tp)
        self.rooms.taken(tier)
        entry = self.in_flight.take(tp, record.offset, tier)
        entry.fair_ticket = held
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
            if isinstance(entry.fair_ticket, Held):
                self.held.settle(entry.fair_ticket, entry.used_tokens)
            if completed and not entry.handed_off:
                self.watermarks.finished(tp, record.offset)
                self._schedule_commit()
            elif entry.fenced:
                self._retake_later(tp, record)
            self._room.set()

    # --- commits and hand-off ----------------------------------------------------------------------
    def _schedule_commit(self) -> None:
        """Commit soon, once for all requests finishing within ``commit_interval_s``: a commit per request
        costs the broker and this event loop a round trip each, on the machine that serves first tokens."""
        self._commit_wanted = True
        if self._commit_task is None or self._commit_task.done():
            self._commit_task = asyncio.create_task(self._commit_later(), name="worker-commit")

    async def _commit_later(self) -> None:
        while True:
            await asyncio.sleep(self.config.commit_interval_s)
            # What finishes while the commit is on its way to the broker was not in it: go round once more
            # rather than leave that offset uncommitted until some later request finishes (a crash would then
            # re-deliver a request that had already ended).
            self._commit_wanted = False
            await self.commit()
            if not self._commit_wanted:
                return

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
        await cancel_and_wait(self._commit_task, *self._retakes)
        await self.commit()

    def owned_anew(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self._owned[tp] = self._owned.get(tp, 0) + 1

    def _retake_later(self, tp: TopicPartition, record: Any) -> None:
        """Pick a fenced request up again if its partition is still here, unmoved, a session timeout later.

        The owner that fenced it took the partition while this worker was paused or cut off; this worker's
        consumer learns of that at its next heartbeat and rebalances (the request then goes with its partition).
        A partition still here after that was given back, with the request's offset unfinished: nobody else
        will serve it."""
        owned = self._owned.get(tp)

        async def retake() -> None:
            await asyncio.sleep(self.config.session_timeout_ms / 1000)
            if (
                tp in self.consumer.assignment()
                and self._owned.get(tp) == owned
                and self.watermarks.holds(tp, record.offset)
            ):
                log.info(
                    "worker.retaking_fenced", extra={"partition": f"{tp.topic}:{tp.partition}", "offset": record.offset}
                )
                self._hold(record, again=True)
                self._room.set()

        task = asyncio.create_task(retake(), name=f"retake-{tp.topic}:{tp.partition}:{record.offset}")
        self._retakes.add(task)
        task.add_done_callback(self._retakes.discard)

    async def hand_off(self, revoked: set[TopicPartition]) -> None:
        """Partitions are being taken away: stop their requests, persist, commit, forget them."""
        if not revoked:
            return
        moving = [entry for entry in self.in_flight if entry.partition in revoked]
        # Held, never started: the new owner re-reads them from the commit (their offsets were never finished).
        self.held.drop(lambda item: TopicPartition(item[0].topic, item[0].partition) not in revoked)
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
