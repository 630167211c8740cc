"""Writing request events and status records to Redis: one pipelined round trip per flush, every write fenced.

Appends use explicit entry ids derived from ``seq``, so an append replayed after a crash or a
retry is refused by Redis itself and a client never sees an event twice. Each flush sends every
pending event of every request in one pipelined round trip: one call of the fenced-write script for all of them
(:mod:`.fencing`), which refuses the writes of an owner whose epoch a newer owner has passed.

With ``replica_ack`` on (the default for ``redis+sentinel://`` URLs) the publisher also keeps every stream
event it flushed until a replica has acknowledged it, and after any failed flush or new connection (the primary
died or was demoted) re-appends those before anything new: an append the old primary acknowledged but never
replicated is restored on the promoted replica instead of leaving a gap. See :class:`StreamPublisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import DoneEvent, ErrorEvent, Names, StreamEvent, stream_entry_id
from sluicegate.telemetry import untraced

from .fencing import FencedOp, FencedWrites, fenced_replies

log = logging.getLogger(__name__)

# Refusals that mean "not now" rather than "never": a primary short of the replicas it must write with
# (``min-replicas-to-write``), a replica cut off from its primary. Retried as an outage is, nothing written.
_PASSING_REFUSALS = ("NOREPLICAS", "MASTERDOWN")

#: Errors that mean "Redis is not reachable right now" (down, restarting, loading its data, or a replica
#: not yet promoted): callers wait and retry instead of failing the request.
REDIS_UNAVAILABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)


class _Reconnected(RedisConnectionError):
    """The publisher's client opened a new connection while events await a replica: the old connection may have
    gone with a primary that failed over, so the flush fails and re-appends them first."""


class _ScriptLoaded(RedisConnectionError):
    """The server lacked the fenced-write script (a restart, or a promoted replica: Redis does not replicate
    ``SCRIPT LOAD``); it is loaded now and the flush is sent again, kept events first."""


@dataclass(frozen=True)
class RecordWrite:
    """A status-record SET of ``request_id`` carried in the publisher's next pipeline, in order with its appends."""

    key: str
    value: str
    ttl_s: int
    request_id: str


@dataclass(frozen=True)
class _Append:
    """A stream event and the stream it goes to, named when it was added (the keys may carry its tenant), and the
    owner epoch it is written as."""

    key: str
    event: StreamEvent
    epoch_key: str
    epoch: int

    @property
    def request_id(self) -> str:
        return self.event.request_id


@dataclass(frozen=True)
class _Record:
    """A status record and the owner epoch it is written as."""

    write: RecordWrite
    epoch_key: str
    epoch: int

    @property
    def request_id(self) -> str:
        return self.write.request_id


@dataclass
class _Unconfirmed:
    """Stream events of one flush that no replica had acknowledged yet, and the primary's replication offset
    right after that flush's appends (a replica whose acknowledged offset reaches it holds them)."""

    offset: int
    events: list[_Append]


class StreamPublisher:
    """Buffers events from all active requests and appends them in one pipeline per flush.

    A lost Redis connection is retried with backoff while events stay buffered, so a Redis
    restart delays tokens but loses none. Each item is written as the owner of an epoch (:mod:`.fencing`); the
    writes of a request whose epoch was passed are refused, counted in ``fenced`` and reported to ``on_fenced``
    (request id, its epoch, the epoch held now).

    ``replica_ack``: each flush's pipeline ends with ``ROLE``, which answers the primary's replication offset
    after the appends and each replica's acknowledged offset (replicas acknowledge about once a second); the
    flushed events are kept until a replica's offset reaches theirs. A flush that fails re-sends the kept events
    first, in order: after a failover the promoted replica gets back what it never received, and ids derived
    from ``seq`` refuse the ones it has. This costs no extra round trip and never waits for a replica (``WAIT``
    would add the replication round trip to every flush, and its whole timeout while no replica is connected).
    The client given must not retry pipelines itself (``create_redis(retries=0)``): a retry that reached the
    promoted replica would append past the gap before the kept events could fill it. A new connection of that client
    while events are kept fails the flush the same way: redis-py replaces a connection dropped while idle without
    an error, and it may have gone with a primary that failed over. Status-record writes are not
    kept: a ``SET`` replayed late could overwrite a newer record. At most ``max_unconfirmed`` events are kept
    (the oldest go first, counted in ``unconfirmed_dropped``) for a primary left without replicas.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        ttl_s: int,
        max_retry_delay_s: float = 2.0,
        *,
        on_send: Callable[[list[StreamEvent | RecordWrite]], None] | None = None,
        replica_ack: bool = False,
        max_unconfirmed: int = 50_000,
        worker_id: str = "",
        on_fenced: Callable[[str, int, int], None] | None = None,
    ):
        self._redis = redis
        self._fenced_writes = FencedWrites(redis, worker_id, ttl_s)
        self.on_fenced = on_fenced
        # Called with each batch as its pipeline goes out (see ``observer.WorkerObserver.events_sending``).
        self._on_send = on_send
        self._names = names
        self.ttl_s = ttl_s
        self._max_retry_delay_s = max_retry_delay_s
        self._pending: list[_Append | _Record] = []
        self._riders: list[asyncio.Future[None]] = []  # of :meth:`ride`, resolved by the flush carrying them
        # Items added so far, and how many of the first of them Redis holds: a flush that finds what it was
        # called for already sent by another leaves the items added since to the next flush.
        self._added = 0
        self._sent = 0
        self._lock = asyncio.Lock()
        self.replica_ack = replica_ack
        self.replicas = 0  # replicas the primary listed in the last ROLE (replica_ack only)
        if replica_ack:
            # Every connection the pool opens from now on tells the publisher first (see ``_connected``).
            redis.connection_pool.connection_kwargs["redis_connect_func"] = self._connected
        self._max_unconfirmed = max_unconfirmed
        self._unconfirmed: deque[_Unconfirmed] = deque()
        self._unconfirmed_events = 0  # their total, kept as they come and go (no sum on the hot path)
        self.appended = 0
        self.duplicates = 0
        self.retries = 0
        self.reappended = 0  # unconfirmed events sent again after a failed flush or a new connection
        self.unconfirmed_dropped = 0
        self.fenced = 0  # script calls refused for a stale epoch

    def add(self, item: StreamEvent | RecordWrite, tenant: str | None = None, epoch: int = 0) -> None:
        """Queue a stream event or a status-record write of ``tenant``'s request for the next flush, written as the
        owner of ``epoch`` (0: never picked up, refused once any worker has picked the request up)."""
        epoch_key = self._names.epoch_key(item.request_id, tenant)
        if isinstance(item, RecordWrite):
            self._pending.append(_Record(item, epoch_key, epoch))
        else:
            self._pending.append(_Append(self._names.stream_key(item.request_id, tenant), item, epoch_key, epoch))
        self._added += 1

    async def ride(
        self, item: StreamEvent | RecordWrite, max_wait_s: float, tenant: str | None = None, epoch: int = 0
    ) -> None:
        """Queue ``item`` and return once Redis has it: carried by the next flush anyone makes (the flush loop's,
        for other requests' appends), or by a flush of its own after ``max_wait_s``.

        For writes that must be stored before the caller goes on but are not worth a round trip of their own
        while other requests keep the flush loop busy (a request's final status record).
        """
        carried: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.add(item, tenant, epoch)
        mine = self._added
        self._riders.append(carried)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(carried), max_wait_s)
        if not carried.done():
            await self.flush(upto=mine)  # carries it, or waits out the flush that already took it
        await carried

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def unconfirmed(self) -> int:
        """Stream events flushed but not yet acknowledged by a replica (0 unless ``replica_ack``)."""
        return self._unconfirmed_events

    async def flush(self, upto: int | None = None) -> None:
        """Append everything buffered; returns once Redis has it (retrying through outages).

        Returns at once when a flush that was under way sent every item added before this call (or before the
        ``upto``-th item): what came after waits for the next flush rather than going alone (a running record
        meant to ride with its request's first token).

        With ``replica_ack`` and events awaiting a replica, a flush with nothing new only asks for the
        replicas' offsets (the flush loop calls it when idle, so a failover is noticed and repaired then too).
        """
        await self._flush(self._added if upto is None else upto, None)

    async def flush_reading(self, reads: Callable[[Pipeline], None]) -> list[Any]:
        """Flush everything buffered with ``reads`` (commands queued on the pipeline after the appends) in the same
        round trip; returns their replies (an error reply as its exception), retrying through outages as
        :meth:`flush` does. A read that has to go to Redis anyway takes the buffered writes along."""
        return await self._flush(self._added, reads)

    async def _flush(self, target: int, reads: Callable[[Pipeline], None] | None) -> list[Any]:
        async with self._lock:
            if reads is None and (not self._pending or self._sent >= target) and not self._unconfirmed:
                return []
            taken = self._added
            batch, self._pending = self._pending, []
            riders, self._riders = self._riders, []
            delay = 0.05
            try:
                while True:
                    try:
                        replies = await self._append(batch, reads)
                        self._sent = taken
                        for carried in riders:
                            if not carried.done():
                                carried.set_result(None)
                        return replies
                    except REDIS_UNAVAILABLE as exc:
                        self.retries += 1
                        if self._unconfirmed:
                            # The primary may have died or been demoted: what no replica acknowledged goes
                            # first, so the promoted replica's streams continue without a gap.
                            kept = [event for u in self._unconfirmed for event in u.events]
                            self._unconfirmed.clear()
                            self._unconfirmed_events = 0
                            self.reappended += len(kept)
                            batch = [*kept, *batch]
                        log.warning("redis append failed; retrying", extra={"error": str(exc), "n": len(batch)})
                        if isinstance(exc, _Reconnected | _ScriptLoaded):
                            continue  # nothing is down (any more): send again at once, not after the backoff
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self._max_retry_delay_s)
            except BaseException:
                # Cancelled (a drain timeout) or failed: the batch holds other requests' events too, and
                # dropping them would leave gaps in their streams; keep them for the next flush, in order.
                self._pending[:0] = batch
                self._riders[:0] = riders
                raise

    async def _append(
        self, batch: list[_Append | _Record], reads: Callable[[Pipeline], None] | None = None
    ) -> list[Any]:
        """One pipeline: the batch's writes (one fenced-write call, each request's items in order as the owner of its
        epoch), ``ROLE`` with ``replica_ack``, then ``reads``; returns the replies of ``reads``. Raises when Redis is
        unavailable for any of them (the caller retries everything)."""
        if self._on_send is not None and batch:
            self._on_send([item.write if isinstance(item, _Record) else item.event for item in batch])
        # Items of different requests commute (other keys); each request's keep their order.
        owners: dict[tuple[str, int], list[_Append | _Record]] = {}
        for item in batch:
            owners.setdefault((item.epoch_key, item.epoch), []).append(item)
        pipe = self._redis.pipeline(transaction=False)
        if owners:
            self._fenced_writes.queue(
                pipe, [(key, epoch, [_op(i) for i in items]) for (key, epoch), items in owners.items()]
            )
        if self.replica_ack:
            pipe.execute_command("ROLE")
        writes = len(pipe)
        if reads is not None:
            reads(pipe)
        # Appends alone are many requests' events: a span of no single request. With reads, it is the reading
        # request's round trip (its pickup), which the others' writes ride: traced under that request.
        with untraced() if reads is None else contextlib.nullcontext():
            results = await pipe.execute(raise_on_error=False)
        results, replies = results[:writes], results[writes:]
        role = results.pop() if self.replica_ack else None
        for reply in replies:
            if isinstance(reply, REDIS_UNAVAILABLE):
                raise reply
        events: list[_Append] = []
        for result in results:
            if isinstance(result, NoScriptError):
                # A server that never loaded the script (restarted, or a replica promoted): load it and send the
                # flush again, kept events first, as after any failover.
                await self._fenced_writes.load()
                raise _ScriptLoaded("the fenced-write script was missing; loaded") from result
            if isinstance(result, ResponseError):
                if str(result).startswith(_PASSING_REFUSALS):
                    raise RedisConnectionError(str(result)) from result
                raise result
            if isinstance(result, REDIS_UNAVAILABLE):
                raise result
        written = fenced_replies(results[0]) if owners else []
        for items, (refused, n) in zip(owners.values(), written, strict=True):
            if refused:
                self.fenced += 1
                if self.on_fenced is not None:
                    self.on_fenced(items[0].request_id, items[0].epoch, n)
                continue
            self.duplicates += n
            events += [item for item in items if isinstance(item, _Append)]
        self.appended += len(events)
        if role is not None:
            self._track_replicas(role, events)
        return replies

    async def _connected(self, connection: Any) -> None:
        """Each new connection of the publisher's client: the usual set-up, then a failed flush if events await a
        replica (:class:`_Reconnected`); the retry re-appends them first and connects again."""
        await connection.on_connect()
        if self._unconfirmed:
            raise _Reconnected("a new Redis connection while stream events await a replica")

    def _track_replicas(self, role: Any, events: list[_Append]) -> None:
        """Keep this flush's events until a replica acknowledges them; forget those it now has."""
        if isinstance(role, REDIS_UNAVAILABLE):
            raise role
        if isinstance(role, ResponseError) or not role or role[0] != b"master":
            # A replica answering (the appends failed READONLY and raised above) or no ROLE: keep everything.
            raise ReadOnlyError(f"stream appends went to a server that is not a primary: {role!r}")
        offset = int(role[1])
        self.replicas = len(role[2])
        acked = max((int(replica[2]) for replica in role[2]), default=-1)
        if events:
            self._unconfirmed.append(_Unconfirmed(offset, events))
            self._unconfirmed_events += len(events)
        while self._unconfirmed and self._unconfirmed[0].offset <= acked:
            self._unconfirmed_events -= len(self._unconfirmed.popleft().events)
        while self._unconfirmed_events > self._max_unconfirmed:
            dropped = self._unconfirmed.popleft()
            self._unconfirmed_events -= len(dropped.events)
            self.unconfirmed_dropped += len(dropped.events)
            log.warning("stream events no replica acknowledged were dropped", extra={"n": len(dropped.events)})


def _op(item: _Append | _Record) -> FencedOp:
    if isinstance(item, _Record):
        return FencedOp.record(item.write.key, item.write.value, item.write.ttl_s)
    ends = isinstance(item.event, DoneEvent | ErrorEvent)  # a finished stream expires after the TTL
    return FencedOp.append(item.key, stream_entry_id(item.event.seq), item.event.model_dump_json(), ends)
