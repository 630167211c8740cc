"""Fan-out of Redis streams to many subscribers over a few Redis connections.

A few reader tasks (one by default) each hold one dedicated connection and issue a single
multi-stream ``XREAD BLOCK`` over every stream that has a subscriber. Each entry is decoded once and
appended to every subscriber's bounded buffer. When a stream joins, ``CLIENT UNBLOCK`` wakes the
blocked reader so its next ``XREAD`` includes the new key; the block timeout is only a backstop.

A subscriber that joins a stream the hub already reads first fetches, with ``XRANGE``, the entries
between its ``last_id`` and the hub's cursor for that stream, then continues from its buffer. Only a
stream's reader advances that cursor, so everything after it reaches the buffer; dedupe by ``seq``
makes the seam exact. A subscriber whose buffer overflows is dropped (:class:`SlowConsumer`) and
resumes losslessly by reconnecting with its last entry id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError

from schemas import Names, stream_entry_id

from .wire import START_SEQ, Relayed, to_relayed

log = logging.getLogger(__name__)

# Seconds a blocking read may take beyond its BLOCK before the connection counts as dead.
_READ_GRACE_S = 10.0


@dataclass(frozen=True)
class RelayConfig:
    """Tuning of the relay; the defaults suit one process serving thousands of clients."""

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
    #: Seconds between SSE keepalive comments while a stream is quiet.
    sse_keepalive_s: float = 15.0
    #: CLIENT SETNAME of every connection, so operators can count the service's connections.
    client_name: str = "sluicegate-result"

    def __post_init__(self) -> None:
        for name in ("readers", "block_ms", "read_count", "history_page", "max_pending", "max_commands"):
            if getattr(self, name) < 1:
                raise ValueError(f"RelayConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"RelayConfig.sse_keepalive_s must be > 0, got {self.sse_keepalive_s}")


def _entry_id_after(seq: int) -> str:
    """The entry id to read after to get the events following ``seq`` (``0-0``: from the start)."""
    return stream_entry_id(seq) if seq >= 0 else "0-0"


class SlowConsumer(Exception):
    """The subscriber fell more than ``max_pending`` events behind and was dropped."""


class _Stream:
    """The hub's state for one stream key: its read cursor and its subscribers."""

    __slots__ = ("cursor", "ended", "key", "read_after", "reader", "subscribers")

    def __init__(self, key: str, cursor: int, reader: _Reader) -> None:
        self.key = key
        #: Seq of the last event the reader relayed; only the reader moves it.
        self.cursor = cursor
        #: Id of the last entry the reader consumed, valid or not (a malformed entry is read only once).
        self.read_after = _entry_id_after(cursor)
        self.ended = False
        self.reader = reader
        self.subscribers: set[Subscription] = set()


class Subscription:
    """One client's view of one stream: history first, then the live tail, each event exactly once."""

    def __init__(self, hub: StreamHub, stream: _Stream, after_seq: int) -> None:
        self._hub = hub
        self._stream = stream
        self.key = stream.key
        #: Seq of the last event handed out; resume point.
        self.last_seq = after_seq
        # Entries (after_seq, history_until] passed the reader before we joined: read them with XRANGE.
        self._history_after: str | None = _entry_id_after(after_seq) if stream.cursor > after_seq else None
        self._history_until = stream.cursor
        self._batches: deque[list[Relayed]] = deque()
        self._pending = 0
        self._ready = asyncio.Event()
        self.overflowed = False
        #: True once the terminal event (done or error) has been handed out.
        self.finished = False

    def _push(self, items: list[Relayed]) -> None:
        if self.overflowed:
            return
        # Falling behind is what counts, not a large batch (one XREAD can return read_count entries).
        if self._pending and self._pending + len(items) > self._hub.config.max_pending:
            self.overflowed = True
            self._batches.clear()
            self._hub._detach(self)
        else:
            self._batches.append(items)
            self._pending += len(items)
        self._ready.set()

    def _accept(self, items: Sequence[Relayed]) -> list[Relayed]:
        out: list[Relayed] = []
        last = self.last_seq
        for item in items:
            if item.seq <= last:
                continue
            out.append(item)
            last = item.seq
            if item.terminal:
                self.finished = True
                break
        self.last_seq = last
        return out

    async def next_batch(self, max_wait_s: float | None = None) -> list[Relayed]:
        """The next events in order (never empty unless ``max_wait_s`` passed or the stream finished).

        Raises :class:`SlowConsumer` once the subscriber has been dropped for falling behind.
        """
        while not self.finished:
            if self.overflowed:
                raise SlowConsumer(f"more than {self._hub.config.max_pending} events behind")
            if self._history_after is not None:
                items, self._history_after = await self._hub._read_history(
                    self.key, self._history_after, self._history_until
                )
                out = self._accept(items)
                if out:
                    return out
                continue
            if self._batches:
                batch = self._batches.popleft()
                self._pending -= len(batch)
                out = self._accept(batch)
                if out:
                    return out
                continue
            if self._stream.ended and self.last_seq >= self._stream.cursor:
                # Joined after the terminal event it had already seen: nothing more will come.
                self.finished = True
                break
            self._ready.clear()
            if max_wait_s is None:
                await self._ready.wait()
            else:
                try:
                    await asyncio.wait_for(self._ready.wait(), max_wait_s)
                except TimeoutError:
                    return []
        return []


class _Reader:
    """One dedicated connection running one multi-stream XREAD over its share of the streams."""

    def __init__(self, hub: StreamHub, index: int) -> None:
        self.hub = hub
        self.index = index
        self.streams: dict[str, _Stream] = {}
        self._changed = asyncio.Event()
        self._generation = 0
        self._in_flight: int | None = None
        self._client_id: int | None = None
        self._conn: AbstractConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._waker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"relay-reader-{self.index}")

    async def close(self) -> None:
        for task in (self._waker, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._conn is not None:
            # A cancelled blocking read leaves a reply pending: the connection cannot be reused.
            await self._conn.disconnect()
            await self.hub.redis.connection_pool.release(self._conn)
            self._conn = None

    def added(self) -> None:
        """A stream joined: make the next XREAD include it, waking a blocked one."""
        self._generation += 1
        self._changed.set()
        if self._in_flight is not None and (self._waker is None or self._waker.done()):
            self._waker = asyncio.create_task(self._unblock(), name=f"relay-waker-{self.index}")

    async def _unblock(self) -> None:
        # CLIENT UNBLOCK can arrive before the XREAD it targets; retry until the reader runs an XREAD
        # that was issued after the change (or is between reads).
        while self._in_flight is not None and self._in_flight < self._generation:
            if self._client_id is not None:
                try:
                    async with self.hub._commands:
                        if await self.hub.redis.client_unblock(self._client_id):
                            return
                except RedisError as exc:
                    log.warning("relay.unblock_failed reader=%d error=%r", self.index, exc)
                    return
            await asyncio.sleep(0.001)

    async def _command(self, *args: Any) -> Any:
        if self._conn is None:
            self._conn = await self.hub.redis.connection_pool.get_connection()
        await self._conn.send_command(*args)
        # Longer than any XREAD block (the pool's socket timeout may be shorter or absent), yet bounded:
        # a connection that silently stopped answering is replaced instead of hanging the reader.
        return await self._conn.read_response(timeout=self.hub.config.block_ms / 1000 + _READ_GRACE_S)

    async def _run(self) -> None:
        config = self.hub.config
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
                log.warning("relay.read_failed reader=%d error=%r retry_in_s=%.2f", self.index, exc, backoff)
                self._client_id = None
                if self._conn is not None:
                    await self._conn.disconnect()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            if reply:
                self._dispatch(reply, active)
                # One loop turn for the subscribers' senders, so the frames clients wait for go out before this
                # reader's next XREAD (a loopback send that also does Redis's receive work) does.
                await asyncio.sleep(0)

    def _dispatch(self, reply: Any, requested: dict[str, _Stream]) -> None:
        per_stream = reply.items() if isinstance(reply, dict) else reply
        for raw_key, entries in per_stream:
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            stream = requested.get(key)
            # A stream dropped and re-added while the read was in flight has a new cursor lineage.
            if stream is None or self.streams.get(key) is not stream:
                continue
            items: list[Relayed] = []
            for entry_id, fields in entries:
                stream.read_after = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                item = to_relayed(key, entry_id, fields)
                if item is None or item.seq <= stream.cursor:
                    continue
                stream.cursor = item.seq
                items.append(item)
                if item.terminal:
                    stream.ended = True
                    break
            if items:
                for sub in list(stream.subscribers):
                    sub._push(items)


class StreamHub:
    """Subscriptions to request streams, served by a few shared blocking readers."""

    def __init__(self, redis: Redis, names: Names, config: RelayConfig | None = None) -> None:
        self.redis = redis
        self.names = names
        self.config = config or RelayConfig()
        self._commands = asyncio.Semaphore(self.config.max_commands)
        self._readers = [_Reader(self, i) for i in range(self.config.readers)]
        self._started = False

    async def start(self) -> None:
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

    def _reader_for(self, key: str) -> _Reader:
        if len(self._readers) == 1:
            return self._readers[0]
        return self._readers[zlib.crc32(key.encode()) % len(self._readers)]

    @contextlib.asynccontextmanager
    async def subscribe(self, request_id: str, after_seq: int = START_SEQ) -> AsyncIterator[Subscription]:
        """Subscribe to ``request_id``'s stream from the event after ``after_seq``."""
        if not self._started:
            raise RuntimeError("StreamHub.subscribe() before start()")
        key = self.names.stream_key(request_id)
        reader = self._reader_for(key)
        stream = reader.streams.get(key)
        if stream is None:
            # The first subscriber sets where the reader starts, so it needs no history read.
            stream = _Stream(key, after_seq, reader)
            reader.streams[key] = stream
            reader.added()
        sub = Subscription(self, stream, after_seq)
        stream.subscribers.add(sub)
        try:
            yield sub
        finally:
            self._detach(sub)

    def _detach(self, sub: Subscription) -> None:
        stream = sub._stream
        stream.subscribers.discard(sub)
        if not stream.subscribers and stream.reader.streams.get(stream.key) is stream:
            del stream.reader.streams[stream.key]

    async def _read_history(self, key: str, after_id: str, until_seq: int) -> tuple[list[Relayed], str | None]:
        """One XRANGE page of the entries after ``after_id`` up to seq ``until_seq``, and the id to
        continue after (None once the range is exhausted; entries trimmed or expired just end it early)."""
        page = self.config.history_page
        async with self._commands:
            entries = await self.redis.xrange(key, f"({after_id}", stream_entry_id(until_seq), count=page)
        items = [item for entry_id, fields in entries if (item := to_relayed(key, entry_id, fields))]
        if len(entries) < page:
            return items, None
        last = entries[-1][0]
        return items, last.decode() if isinstance(last, bytes) else last

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[Redis]:
        """The shared client, for short commands, within the hub's bound on concurrent commands (and
        so on pool connections)."""
        async with self._commands:
            yield self.redis
