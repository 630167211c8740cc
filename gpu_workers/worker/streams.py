"""Writing request events to Redis streams and reading back what a stream already holds.

Appends use explicit entry ids derived from ``seq``, so an append replayed after a crash or a
retry is refused by Redis itself and a client never sees an event twice. Each flush sends every
pending event of every request in one pipelined round trip.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError
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


async def read_stream_state(redis: aioredis.Redis, names: Names, request_id: str) -> StreamState:
    """Replay the stream's events (honouring ``restart``) into the tokens a client has received."""
    return stream_state_from_entries(await redis.xrange(names.stream_key(request_id)))


@dataclass
class PickupState:
    """Everything a worker reads before it starts a request, fetched in one round trip."""

    stream: StreamState
    record: bytes | None  # the RequestRecord JSON, if any
    cancel_marked: bool

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


async def read_pickup_state(redis: aioredis.Redis, names: Names, request_id: str) -> PickupState:
    """The stream, the status record and the cancel marker in one pipelined round trip.

    Three sequential reads cost about 10 ms p50 of pickup latency on a loaded box (benchmarks/pipeline.py).
    """
    pipe = redis.pipeline(transaction=False)
    pipe.xrange(names.stream_key(request_id))
    pipe.get(names.request_key(request_id))
    pipe.exists(names.cancel_key(request_id))
    entries, record, cancel = await pipe.execute()
    return PickupState(stream_state_from_entries(entries), record, bool(cancel))


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


class StreamPublisher:
    """Buffers events from all active requests and appends them in one pipeline per flush.

    A lost Redis connection is retried with backoff while events stay buffered, so a Redis
    restart delays tokens but loses none.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        ttl_s: int,
        max_retry_delay_s: float = 2.0,
        *,
        on_send: Callable[[list[StreamEvent | RecordWrite]], None] | None = None,
    ):
        self._redis = redis
        # Called with each batch as its pipeline goes out (see ``observer.WorkerObserver.events_sending``).
        self._on_send = on_send
        self._names = names
        self._ttl_s = ttl_s
        self._max_retry_delay_s = max_retry_delay_s
        self._pending: list[StreamEvent | RecordWrite] = []
        self._lock = asyncio.Lock()
        self.appended = 0
        self.duplicates = 0
        self.retries = 0

    def add(self, item: StreamEvent | RecordWrite) -> None:
        """Queue a stream event or a status-record write for the next flush (no round trip of its own)."""
        self._pending.append(item)

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> None:
        """Append everything buffered; returns once Redis has it (retrying through outages)."""
        async with self._lock:
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            delay = 0.05
            try:
                while True:
                    try:
                        await self._append(batch)
                        return
                    except REDIS_UNAVAILABLE as exc:
                        self.retries += 1
                        log.warning("redis append failed; retrying", extra={"error": str(exc), "n": len(batch)})
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self._max_retry_delay_s)
            except BaseException:
                # Cancelled (a drain timeout) or failed: the batch holds other requests' events too, and
                # dropping them would leave gaps in their streams; keep them for the next flush, in order.
                self._pending[:0] = batch
                raise

    async def _append(self, batch: list[StreamEvent | RecordWrite]) -> None:
        if self._on_send is not None:
            self._on_send(batch)
        pipe = self._redis.pipeline(transaction=False)
        for event in batch:
            if isinstance(event, RecordWrite):
                pipe.set(event.key, event.value, ex=event.ttl_s)
                continue
            key = self._names.stream_key(event.request_id)
            pipe.xadd(key, {STREAM_FIELD: event.model_dump_json()}, id=stream_entry_id(event.seq))
            if isinstance(event, DoneEvent | ErrorEvent):
                pipe.expire(key, self._ttl_s)
        with untraced():  # one pipeline for many requests' events: a span of no single request
            results = await pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, ResponseError):
                if _DUPLICATE_ID in str(result):
                    self.duplicates += 1
                    continue
                raise result
            if isinstance(result, REDIS_UNAVAILABLE):
                raise result
        self.appended += sum(1 for event in batch if not isinstance(event, RecordWrite))
