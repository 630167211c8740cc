"""The one Redis stream follower: read a request's stream from an entry id, then follow its live tail
until the terminal event, for many subscribers over a few Redis connections.

A few reader tasks (one by default) each hold one dedicated connection and issue a single
multi-stream ``XREAD BLOCK`` over every stream that has a subscriber. Each entry is decoded once, by
the user's ``decode`` (the result service makes its wire JSON; ingress, with ``stream_entries.parse_entry``,
the event), and appended to every subscriber's bounded buffer. When a stream joins, ``CLIENT UNBLOCK``
wakes the blocked reader so its next ``XREAD`` includes the new key (sent alone, or in the subscriber's own
first pipeline: :meth:`StreamFollower.execute_waking`); the block timeout is a backstop.

A subscriber (``sluicegate.stream_subscription.Subscription``) that joins a stream the follower already
reads first fetches, with ``XRANGE``, the entries between its resume point and the reader's cursor for that
stream, then continues from its buffer. Only a stream's reader advances that cursor, so everything after it
reaches the buffer; dedupe by ``seq`` makes the seam exact. A subscriber whose buffer overflows is dropped
(``SlowConsumer``) and resumes losslessly by subscribing again after its ``last_seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError

from schemas import Names, stream_entry_id

from .stream_subscription import START_SEQ, StreamState, Subscription, T
from .task_stop import cancel_and_wait
from .telemetry import untraced

log = logging.getLogger(__name__)

# Seconds a blocking read may take beyond its BLOCK before the connection counts as dead.
_READ_GRACE_S = 10.0


#: Turns one entry (stream key, entry id, fields) into the subscribers' item, or None to skip it.
Decode = Callable[[str, bytes | str, Any], T | None]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class FollowerConfig:
    """Tuning of a follower; the defaults suit one process serving thousands of subscribers."""

    #: Reader tasks, each with one connection and one multi-stream XREAD; streams are hashed onto them.
    readers: int = 1
    #: Longest XREAD block; wake-ups normally come sooner through CLIENT UNBLOCK.
    block_ms: int = 1000
    #: Most entries one XREAD returns per stream.
    read_count: int = 512
    #: Entries per XRANGE page when a late subscriber catches up.
    history_page: int = 1000
    #: Events buffered per subscriber before it counts as too slow and is dropped.
    max_pending: int = 4096
    #: Non-blocking Redis commands (history, probes, wake-ups) in flight at once: bounds the pool.
    max_commands: int = 4

    def __post_init__(self) -> None:
        for name in ("readers", "block_ms", "read_count", "history_page", "max_pending", "max_commands"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")


class _Reader(Generic[T]):
    """One dedicated connection running one multi-stream XREAD over its share of the streams."""

    def __init__(self, follower: StreamFollower[T], index: int) -> None:
        self.follower = follower
        self.index = index
        self.streams: dict[str, StreamState[T, _Reader[T]]] = {}
        self._changed = asyncio.Event()
        self._generation = 0
        self._in_flight: int | None = None
        self._client_id: int | None = None
        self._conn: AbstractConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._waker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"stream-reader-{self.index}")

    async def close(self) -> None:
        await cancel_and_wait(self._waker, self._task)
        if self._conn is not None:
            # A cancelled blocking read leaves a reply pending: the connection cannot be reused.
            await self._conn.disconnect()
            await self.follower.redis.connection_pool.release(self._conn)
            self._conn = None

    def added(self, *, wake: bool = True) -> None:
        """A stream joined: make the next XREAD include it, waking a blocked one (``wake=False``: the subscriber
        carries the wake-up in a pipeline of its own, :meth:`StreamFollower.execute_waking`)."""
        self._generation += 1
        self._changed.set()
        if wake:
            self.wake()

    @property
    def needs_wake(self) -> bool:
        """A blocked XREAD was issued before the last stream joined, so it does not include it."""
        return self._in_flight is not None and self._in_flight < self._generation

    def wake(self) -> None:
        """Unblock the XREAD in flight (in the background, retrying) if it misses a stream that joined."""
        if self.needs_wake and (self._waker is None or self._waker.done()):
            self._waker = asyncio.create_task(self._unblock(), name=f"stream-waker-{self.index}")

    async def _unblock(self) -> None:
        # CLIENT UNBLOCK can arrive before the XREAD it targets; retry until the reader runs an XREAD
        # that was issued after the change (or is between reads).
        while self.needs_wake:
            if self._client_id is not None:
                try:
                    # Wakes the reader shared by every stream: a call of no single request's trace.
                    async with self.follower._commands:
                        with untraced():
                            unblocked = await self.follower.redis.client_unblock(self._client_id)
                        if unblocked:
                            return
                except RedisError as exc:
                    log.warning("stream.unblock_failed reader=%d error=%r", self.index, exc)
                    return
            await asyncio.sleep(0.001)

    async def _command(self, *args: Any) -> Any:
        if self._conn is None:
            self._conn = await self.follower.redis.connection_pool.get_connection()
        await self._conn.send_command(*args)
        # Longer than any XREAD block (the pool's socket timeout may be shorter or absent), yet bounded:
        # a connection that silently stopped answering is replaced instead of hanging the reader.
        return await self._conn.read_response(timeout=self.follower.config.block_ms / 1000 + _READ_GRACE_S)

    async def _run(self) -> None:
        config = self.follower.config
        backoff = 0.05
        while True:
            active = {key: s for key, s in self.streams.items() if not s.ended}
            if not active:
                self._changed.clear()
                await self._changed.wait()
                continue
            args: list[Any] = ["XREAD", "COUNT", config.read_count, "BLOCK", config.block_ms, "STREAMS"]
            args.extend(active)
            args.extend(s.read_after for s in active.values())
            try:
                if self._client_id is None:
                    self._client_id = int(await self._command("CLIENT", "ID"))
                self._in_flight = self._generation
                try:
                    reply = await self._command(*args)
                finally:
                    self._in_flight = None
            except (RedisError, OSError) as exc:
                log.warning("stream.read_failed reader=%d error=%r retry_in_s=%.2f", self.index, exc, backoff)
                self._client_id = None
                if self._conn is not None:
                    await self._conn.disconnect()
                for stream in self.streams.values():
                    for sub in stream.subscribers:
                        if sub.fail_fast:
                            sub.fail(exc)
                # A stream that joins meanwhile cuts the wait short: its subscriber hears of Redis at once.
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(backoff):
                        await self._changed.wait()
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            if reply:
                self._dispatch(reply, active)
                # One loop turn for the subscribers, so the frames clients wait for go out before this
                # reader's next XREAD (a loopback send that also does Redis's receive work) does.
                await asyncio.sleep(0)

    def _dispatch(self, reply: Any, requested: dict[str, StreamState[T, _Reader[T]]]) -> None:
        decode = self.follower.decode
        per_stream = reply.items() if isinstance(reply, dict) else reply
        for raw_key, entries in per_stream:
            key = _text(raw_key)
            stream = requested.get(key)
            # A stream dropped and re-added while the read was in flight has a new cursor lineage.
            if stream is None or self.streams.get(key) is not stream:
                continue
            items: list[T] = []
            for entry_id, fields in entries:
                stream.read_after = _text(entry_id)
                item = decode(key, entry_id, fields)
                if item is None or item.seq <= stream.cursor:
                    continue
                stream.cursor = item.seq
                items.append(item)
                if item.terminal:
                    stream.ended = True
                    break
            if items:
                for sub in list(stream.subscribers):
                    sub.push(items)


class StreamFollower(Generic[T]):
    """Subscriptions to request streams, served by a few shared blocking readers; items are what
    ``decode`` makes of each entry (``sluicegate.stream_entries.parse_entry`` gives
    a ``StreamEntry``)."""

    def __init__(self, redis: Redis, names: Names, config: FollowerConfig | None, *, decode: Decode[T]) -> None:
        self.redis = redis
        self.names = names
        self.config = config or FollowerConfig()
        self.decode = decode
        self._commands = asyncio.Semaphore(self.config.max_commands)
        self._readers = [_Reader(self, i) for i in range(self.config.readers)]
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    async def start(self) -> None:
        """Start the reader tasks (on the running event loop); a second call does nothing."""
        if self._started:
            return
        for reader in self._readers:
            reader.start()
        self._started = True

    async def close(self) -> None:
        for reader in self._readers:
            await reader.close()
        self._started = False

    @property
    def stream_count(self) -> int:
        """Streams with at least one subscriber."""
        return sum(len(r.streams) for r in self._readers)

    @property
    def subscriber_count(self) -> int:
        return sum(len(s.subscribers) for r in self._readers for s in r.streams.values())

    def _reader_for(self, key: str) -> _Reader[T]:
        if len(self._readers) == 1:
            return self._readers[0]
        return self._readers[zlib.crc32(key.encode()) % len(self._readers)]

    @contextlib.asynccontextmanager
    async def subscribe(
        self,
        request_id: str,
        after_seq: int = START_SEQ,
        *,
        tenant: str | None = None,
        fail_fast: bool = False,
        wake: bool = True,
    ) -> AsyncIterator[Subscription[T]]:
        """Subscribe to ``request_id``'s stream (of ``tenant``'s request: its key carries it with tenants apart)
        from the event after ``after_seq``; with ``fail_fast``
        the subscription raises the reader's Redis errors instead of waiting for it to reconnect.

        ``wake=False``: the caller's next commands go through :meth:`execute_waking`, which carries the blocked
        reader's wake-up, rather than the wake-up taking a round trip of its own."""
        if not self._started:
            raise RuntimeError("StreamFollower.subscribe() before start()")
        key = self.names.stream_key(request_id, tenant)
        reader = self._reader_for(key)
        stream = reader.streams.get(key)
        if stream is None:
            # The reader starts at the stream's beginning, whatever the first subscriber's resume point: one
            # past the stream's end (its terminal event lies behind it) would otherwise never be read, leaving
            # that subscriber, and any who joins it, waiting for good. The subscriber drops what it has seen.
            stream = StreamState(key, START_SEQ, reader)
            reader.streams[key] = stream
            reader.added(wake=wake)
        sub = Subscription(self, stream, after_seq, fail_fast)
        stream.subscribers.add(sub)
        try:
            yield sub
        finally:
            self.detach(sub)

    def detach(self, sub: Subscription[T]) -> None:
        stream = sub.stream
        stream.subscribers.discard(sub)
        if not stream.subscribers and stream.reader.streams.get(stream.key) is stream:
            del stream.reader.streams[stream.key]

    async def read_history(self, key: str, after_id: str, until_seq: int) -> tuple[list[T], str | None]:
        """One XRANGE page of the entries after ``after_id`` up to seq ``until_seq``, and the id to
        continue after (None once the range is exhausted; entries trimmed or expired just end it early)."""
        page = self.config.history_page
        async with self._commands:
            entries = await self.redis.xrange(key, f"({after_id}", stream_entry_id(until_seq), count=page)
        decode = self.decode
        items = [item for entry_id, fields in entries if (item := decode(key, entry_id, fields)) is not None]
        if len(entries) < page:
            return items, None
        return items, _text(entries[-1][0])

    async def execute_waking(self, sub: Subscription[T], pipe: Pipeline) -> list[Any]:
        """Execute the caller's ``pipe`` with the ``CLIENT UNBLOCK`` that ``sub``'s reader needs appended (for a
        subscription opened with ``wake=False``) and return the caller's replies.

        A new subscriber usually reads something first (the result service's probe): the wake-up rides in that
        round trip instead of one of its own. When it woke nothing (the XREAD had not reached Redis
        yet) or the pipeline failed, the reader's own retrying wake-up takes over."""
        reader = sub.stream.reader
        client_id = reader._client_id if reader.needs_wake else None
        if client_id is not None:
            pipe.client_unblock(client_id)
        woken = False
        try:
            replies = await pipe.execute()
            if client_id is not None:
                woken = bool(replies.pop())
        finally:
            if not woken:
                reader.wake()
        return replies

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[Redis]:
        """The shared client, for short commands, within the follower's bound on concurrent commands
        (and so on pool connections)."""
        async with self._commands:
            yield self.redis
