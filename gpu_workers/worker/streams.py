"""Writing request events to Redis streams and reading back what a stream already holds.

Appends use explicit entry ids derived from ``seq``, so an append replayed after a crash or a
retry is refused by Redis itself and a client never sees an event twice. Each flush sends every
pending event of every request in one pipelined round trip.

With ``replica_ack`` on (the default for ``redis+sentinel://`` URLs) the publisher also keeps every stream
event it flushed until a replica has acknowledged it, and after any failed flush (the primary died or was
demoted) re-appends those before anything new: an append the old primary acknowledged but never replicated
is restored on the promoted replica instead of leaving a gap. See :class:`StreamPublisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import (
    STREAM_FIELD,
    DoneEvent,
    ErrorEvent,
    Names,
    RequestRecord,
    RestartEvent,
    StreamEvent,
    TokenEvent,
    parse_stream_event,
    stream_entry_id,
)
from schemas.events import FinishReason
from sluicegate.telemetry import untraced

log = logging.getLogger(__name__)

# Redis answers this when an explicit id is not above the stream's last one: a replayed append.
_DUPLICATE_ID = "equal or smaller than the target stream top item"
# Refusals that mean "not now" rather than "never": a primary short of the replicas it must write with
# (``min-replicas-to-write``), a replica cut off from its primary. Retried as an outage is, nothing written.
_PASSING_REFUSALS = ("NOREPLICAS", "MASTERDOWN")

#: Errors that mean "Redis is not reachable right now" (down, restarting, loading its data, or a replica
#: not yet promoted): callers wait and retry instead of failing the request.
REDIS_UNAVAILABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)


@dataclass
class DeliveredChoice:
    """What one choice (``n`` > 1) already delivered, and its end if its last event carried one."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


@dataclass
class StreamState:
    """What a request's stream already holds, for continuing it after a re-delivery."""

    exists: bool = False
    next_seq: int = 0
    token_ids: list[int] = field(default_factory=list)  # every choice's, in stream order
    text: str = ""
    done: DoneEvent | None = None
    error: ErrorEvent | None = None
    choices: dict[int, DeliveredChoice] = field(default_factory=dict)  # by index

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    @property
    def delivered(self) -> int:
        return len(self.token_ids)


async def read_stream_state(
    redis: aioredis.Redis, names: Names, request_id: str, tenant: str | None = None
) -> StreamState:
    """Replay the stream's events (honouring ``restart``) into the tokens a client has received."""
    return stream_state_from_entries(await redis.xrange(names.stream_key(request_id, tenant)))


@dataclass
class PickupState:
    """Everything a worker reads before it starts a request, fetched in one round trip."""

    stream: StreamState
    record: bytes | None  # the RequestRecord JSON, if any
    cancel_marked: bool
    # Whether the lease key asked for exists (None: none was asked for; see ``readers``).
    lease_exists: bool | None = None

    @property
    def ended_before(self) -> bool:
        """Whether the status record says the request ended (its stream may since have expired)."""
        if self.record is None:
            return False
        try:
            status = RequestRecord.model_validate_json(self.record).status
        except ValidationError:
            return False
        return status in ("finished", "cancelled", "failed")


async def read_pickup_state(
    publisher: StreamPublisher, names: Names, request_id: str, lease_key: str | None = None, tenant: str | None = None
) -> PickupState:
    """The stream, the status record and the cancel marker (and ``lease_key``'s existence, when given), read in one
    round trip that also carries everything the publisher holds (other requests' appends and status records: a
    round trip fewer for them).

    Three sequential reads cost about 10 ms p50 of pickup latency on a loaded box (benchmarks/pipeline.py).
    """

    def reads(pipe: Pipeline) -> None:
        pipe.xrange(names.stream_key(request_id, tenant))
        pipe.get(names.request_key(request_id, tenant))
        pipe.exists(names.cancel_key(request_id, tenant))
        if lease_key is not None:
            pipe.exists(lease_key)

    replies = await publisher.flush_reading(reads)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    entries, record, cancel, *lease = replies
    return PickupState(stream_state_from_entries(entries), record, bool(cancel), bool(lease[0]) if lease else None)


def stream_state_from_entries(entries: list[Any]) -> StreamState:
    """Fold XRANGE entries into what the client has received."""
    state = StreamState(exists=bool(entries))
    tokens: list[TokenEvent] = []
    for _entry_id, fields in entries:
        event = parse_stream_event(fields[STREAM_FIELD.encode()])
        state.next_seq = event.seq + 1
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, RestartEvent):
            tokens = [t for t in tokens if t.seq <= event.discard_after_seq]
        elif isinstance(event, DoneEvent):
            state.done = event
        elif isinstance(event, ErrorEvent):
            state.error = event
    state.token_ids = [tid for t in tokens for tid in t.token_ids]
    state.text = "".join(t.text for t in tokens)
    for token in tokens:
        choice = state.choices.setdefault(token.index, DeliveredChoice())
        choice.token_ids += token.token_ids
        choice.text += token.text
        choice.finish_reason = token.finish_reason or choice.finish_reason
    return state


@dataclass(frozen=True)
class RecordWrite:
    """A status-record SET carried in the publisher's next pipeline, in order with the stream appends."""

    key: str
    value: str
    ttl_s: int


@dataclass(frozen=True)
class _Append:
    """A stream event and the stream it goes to, named when it was added (the key may carry its tenant)."""

    key: str
    event: StreamEvent


@dataclass
class _Unconfirmed:
    """Stream events of one flush that no replica had acknowledged yet, and the primary's replication offset
    right after that flush's appends (a replica whose acknowledged offset reaches it holds them)."""

    offset: int
    events: list[_Append]


class StreamPublisher:
    """Buffers events from all active requests and appends them in one pipeline per flush.

    A lost Redis connection is retried with backoff while events stay buffered, so a Redis
    restart delays tokens but loses none.

    ``replica_ack``: each flush's pipeline ends with ``ROLE``, which answers the primary's replication offset
    after the appends and each replica's acknowledged offset (replicas acknowledge about once a second); the
    flushed events are kept until a replica's offset reaches theirs. A flush that fails re-sends the kept events
    first, in order: after a failover the promoted replica gets back what it never received, and ids derived
    from ``seq`` refuse the ones it has. This costs no extra round trip and never waits for a replica (``WAIT``
    would add the replication round trip to every flush, and its whole timeout while no replica is connected).
    The client given must not retry pipelines itself (``create_redis(retries=0)``): a retry that reached the
    promoted replica would append past the gap before the kept events could fill it. Status-record writes are not
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
    ):
        self._redis = redis
        # Called with each batch as its pipeline goes out (see ``observer.WorkerObserver.events_sending``).
        self._on_send = on_send
        self._names = names
        self._ttl_s = ttl_s
        self._max_retry_delay_s = max_retry_delay_s
        self._pending: list[_Append | RecordWrite] = []
        self._riders: list[asyncio.Future[None]] = []  # of :meth:`ride`, resolved by the flush carrying them
        # Items added so far, and how many of the first of them Redis holds: a flush that finds what it was
        # called for already sent by another leaves the items added since to the next flush.
        self._added = 0
        self._sent = 0
        self._lock = asyncio.Lock()
        self._replica_ack = replica_ack
        self._max_unconfirmed = max_unconfirmed
        self._unconfirmed: deque[_Unconfirmed] = deque()
        self._unconfirmed_events = 0  # their total, kept as they come and go (no sum on the hot path)
        self.appended = 0
        self.duplicates = 0
        self.retries = 0
        self.reappended = 0  # unconfirmed events sent again after a failed flush
        self.unconfirmed_dropped = 0

    def add(self, item: StreamEvent | RecordWrite, tenant: str | None = None) -> None:
        """Queue a stream event (of ``tenant``'s request) or a status-record write for the next flush."""
        if not isinstance(item, RecordWrite):
            item = _Append(self._names.stream_key(item.request_id, tenant), item)
        self._pending.append(item)
        self._added += 1

    async def ride(self, item: StreamEvent | RecordWrite, max_wait_s: float) -> None:
        """Queue ``item`` and return once Redis has it: carried by the next flush anyone makes (the flush loop's,
        for other requests' appends), or by a flush of its own after ``max_wait_s``.

        For writes that must be stored before the caller goes on but are not worth a round trip of their own
        while other requests keep the flush loop busy (a request's final status record).
        """
        carried: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.add(item)
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
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self._max_retry_delay_s)
            except BaseException:
                # Cancelled (a drain timeout) or failed: the batch holds other requests' events too, and
                # dropping them would leave gaps in their streams; keep them for the next flush, in order.
                self._pending[:0] = batch
                self._riders[:0] = riders
                raise

    async def _append(
        self, batch: list[_Append | RecordWrite], reads: Callable[[Pipeline], None] | None = None
    ) -> list[Any]:
        """One pipeline: the batch's writes, ``ROLE`` with ``replica_ack``, then ``reads``; returns the replies of
        ``reads``. Raises when Redis is unavailable for any of them (the caller retries everything)."""
        if self._on_send is not None and batch:
            self._on_send([item if isinstance(item, RecordWrite) else item.event for item in batch])
        pipe = self._redis.pipeline(transaction=False)
        for item in batch:
            if isinstance(item, RecordWrite):
                pipe.set(item.key, item.value, ex=item.ttl_s)
                continue
            pipe.xadd(item.key, {STREAM_FIELD: item.event.model_dump_json()}, id=stream_entry_id(item.event.seq))
            if isinstance(item.event, DoneEvent | ErrorEvent):
                pipe.expire(item.key, self._ttl_s)
        if self._replica_ack:
            pipe.execute_command("ROLE")
        writes = len(pipe)
        if reads is not None:
            reads(pipe)
        # Appends alone are many requests' events: a span of no single request. With reads, it is the reading
        # request's round trip (its pickup), which the others' writes ride: traced under that request.
        with untraced() if reads is None else contextlib.nullcontext():
            results = await pipe.execute(raise_on_error=False)
        results, replies = results[:writes], results[writes:]
        role = results.pop() if self._replica_ack else None
        for reply in replies:
            if isinstance(reply, REDIS_UNAVAILABLE):
                raise reply
        for result in results:
            if isinstance(result, ResponseError):
                if _DUPLICATE_ID in str(result):
                    self.duplicates += 1
                    continue
                if str(result).startswith(_PASSING_REFUSALS):
                    raise RedisConnectionError(str(result)) from result
                raise result
            if isinstance(result, REDIS_UNAVAILABLE):
                raise result
        events = [item for item in batch if not isinstance(item, RecordWrite)]
        self.appended += len(events)
        if role is not None:
            self._track_replicas(role, events)
        return replies

    def _track_replicas(self, role: Any, events: list[_Append]) -> None:
        """Keep this flush's events until a replica acknowledges them; forget those it now has."""
        if isinstance(role, REDIS_UNAVAILABLE):
            raise role
        if isinstance(role, ResponseError) or not role or role[0] != b"master":
            # A replica answering (the appends failed READONLY and raised above) or no ROLE: keep everything.
            raise ReadOnlyError(f"stream appends went to a server that is not a primary: {role!r}")
        offset = int(role[1])
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
