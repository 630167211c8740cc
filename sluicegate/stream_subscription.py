"""One subscriber's view of one followed stream: the history it missed, then the live tail, each event once.

:class:`Subscription` is what :class:`sluicegate.stream_follower.StreamFollower` hands out (reaching back only
through :class:`Source`); a reader of the follower pushes decoded entries into every subscription of a stream
(:class:`StreamState`). A subscription first pages through the entries that passed the reader before it joined
(``XRANGE``), then drains its bounded buffer, deduplicating by ``seq``; one that falls too far behind is dropped
with :class:`SlowConsumer`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from schemas import stream_entry_id

#: The resume point before the first entry: "nothing seen yet".
START_SEQ = -1


class Followed(Protocol):
    """What a decoded entry must tell the follower: its seq (for dedupe) and whether it ends the stream."""

    @property
    def seq(self) -> int: ...

    @property
    def terminal(self) -> bool: ...


T = TypeVar("T", bound=Followed)
#: The follower's reader that owns a stream: only the follower looks into it.
R = TypeVar("R")


class PendingBound(Protocol):
    """How many events a subscriber may fall behind before it is dropped."""

    @property
    def max_pending(self) -> int: ...


class Source(Protocol[T]):
    """What a subscription asks of the follower that made it (:class:`sluicegate.stream_follower.StreamFollower`),
    named here so that arrows run one way: the follower builds on subscriptions, never the reverse."""

    @property
    def config(self) -> PendingBound: ...

    def detach(self, sub: Subscription[T]) -> None: ...

    async def read_history(self, key: str, after_id: str, until_seq: int) -> tuple[list[T], str | None]: ...


def entry_id_after(seq: int) -> str:
    """The entry id to read after to get the events following ``seq`` (``0-0``: from the start)."""
    return stream_entry_id(seq) if seq >= 0 else "0-0"


class SlowConsumer(Exception):
    """The subscriber fell more than ``max_pending`` events behind and was dropped."""


class StreamState(Generic[T, R]):
    """The follower's state for one stream key: its read cursor and its subscribers."""

    __slots__ = ("cursor", "ended", "key", "read_after", "reader", "subscribers")

    def __init__(self, key: str, cursor: int, reader: R) -> None:
        self.key = key
        #: Seq of the last event the reader passed on; only the reader moves it.
        self.cursor = cursor
        #: Id of the last entry the reader consumed, valid or not (a malformed entry is read only once).
        self.read_after = entry_id_after(cursor)
        self.ended = False
        self.reader = reader
        self.subscribers: set[Subscription[T]] = set()


class Subscription(Generic[T]):
    """One subscriber's view of one stream: history first, then the live tail, each event exactly once."""

    def __init__(self, follower: Source[T], stream: StreamState[T, Any], after_seq: int, fail_fast: bool) -> None:
        self._follower = follower
        self.stream = stream
        self.key = stream.key
        #: Seq of the last event handed out; resume point.
        self.last_seq = after_seq
        # Entries (after_seq, history_until] passed the reader before we joined: read them with XRANGE.
        self._history_after: str | None = entry_id_after(after_seq) if stream.cursor > after_seq else None
        self._history_until = stream.cursor
        self._batches: deque[list[T]] = deque()
        self._pending = 0
        self._ready = asyncio.Event()
        self.overflowed = False
        #: Raise the reader's Redis errors here instead of waiting while it reconnects.
        self.fail_fast = fail_fast
        self._error: BaseException | None = None
        #: True once the terminal event (done or error) has been handed out, or is known to lie at or before the
        #: resume point (``resumed_past_end``).
        self.finished = False
        #: Finished without handing out a terminal event: the subscriber resumed at or past the stream's end.
        self.resumed_past_end = False

    def push(self, items: list[T]) -> None:
        if self.overflowed:
            return
        # Falling behind is what counts, not a large batch (one XREAD can return read_count entries).
        if self._pending and self._pending + len(items) > self._follower.config.max_pending:
            self.overflowed = True
            self._batches.clear()
            self._follower.detach(self)
        else:
            self._batches.append(items)
            self._pending += len(items)
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._ready.set()

    def _accept(self, items: Sequence[T]) -> list[T]:
        out: list[T] = []
        last = self.last_seq
        for item in items:
            if item.seq <= last:
                if item.terminal:  # the stream ended at or before the resume point: nothing more will come
                    self.finished = self.resumed_past_end = True
                    break
                continue
            out.append(item)
            last = item.seq
            if item.terminal:
                self.finished = True
                break
        self.last_seq = last
        return out

    async def next_batch(self, max_wait_s: float | None = None) -> list[T]:
        """The next events in order (never empty unless ``max_wait_s`` passed or the stream finished).

        Raises :class:`SlowConsumer` once the subscriber has been dropped for falling behind, and
        ``RedisError``/``OSError`` when a history read fails (or, with ``fail_fast``, the live read).
        """
        while not self.finished:
            if self.overflowed:
                raise SlowConsumer(f"more than {self._follower.config.max_pending} events behind")
            if self._history_after is not None:
                items, self._history_after = await self._follower.read_history(
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
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self.stream.ended and self.last_seq >= self.stream.cursor:
                # Joined after the terminal event it had already seen: nothing more will come.
                self.finished = self.resumed_past_end = True
                break
            self._ready.clear()
            if max_wait_s is None:
                await self._ready.wait()
            else:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the wait as a task of its
                # own, an extra event-loop hop on every event's way to the subscriber.
                try:
                    async with asyncio.timeout(max_wait_s):
                        await self._ready.wait()
                except TimeoutError:
                    return []
        return []
