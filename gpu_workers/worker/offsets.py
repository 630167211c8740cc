"""Per-partition completion watermarks: the offset a worker may commit without losing a request.

Requests finish out of order; committing offset N tells Kafka every message below N is done. So a
partition's commit point is its lowest unfinished offset (or one past the highest seen when all
are done). A crash re-delivers everything from there, never skipping an unfinished request.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")  # a partition handle, e.g. aiokafka's TopicPartition


@dataclass
class _PartitionState:
    in_flight: set[int] = field(default_factory=set)
    heap: list[int] = field(default_factory=list)  # lazily pruned min-heap over in_flight
    next_offset: int | None = None  # one past the highest offset seen
    committed: int | None = None


class CompletionWatermarks(Generic[P]):
    """Tracks started and finished offsets per partition and says what is safe to commit."""

    def __init__(self) -> None:
        self._parts: dict[P, _PartitionState] = {}

    def started(self, partition: P, offset: int) -> None:
        state = self._parts.setdefault(partition, _PartitionState())
        if offset in state.in_flight:
            return
        state.in_flight.add(offset)
        heapq.heappush(state.heap, offset)
        if state.next_offset is None or offset + 1 > state.next_offset:
            state.next_offset = offset + 1

    def finished(self, partition: P, offset: int) -> None:
        state = self._parts.get(partition)
        if state is None or offset not in state.in_flight:
            raise KeyError(f"offset {offset} of {partition} was not started")
        state.in_flight.remove(offset)

    def watermark(self, partition: P) -> int | None:
        """The offset to commit for ``partition`` (Kafka's "next message to read"), or None."""
        state = self._parts.get(partition)
        if state is None or state.next_offset is None:
            return None
        while state.heap and state.heap[0] not in state.in_flight:
            heapq.heappop(state.heap)
        return state.heap[0] if state.heap else state.next_offset

    def to_commit(self) -> dict[P, int]:
        """Watermarks that moved since the last :meth:`mark_committed`."""
        out: dict[P, int] = {}
        for partition, state in self._parts.items():
            mark = self.watermark(partition)
            if mark is not None and mark != state.committed:
                out[partition] = mark
        return out

    def mark_committed(self, offsets: dict[P, int]) -> None:
        for partition, offset in offsets.items():
            if partition in self._parts:
                self._parts[partition].committed = offset

    def holds(self, partition: P, offset: int) -> bool:
        """Whether ``offset`` of ``partition`` was started here and has not finished."""
        state = self._parts.get(partition)
        return state is not None and offset in state.in_flight

    def in_flight(self, partition: P) -> int:
        state = self._parts.get(partition)
        return len(state.in_flight) if state else 0

    def forget(self, partition: P) -> None:
        """Drop a partition this worker no longer owns (its new owner re-reads from the commit)."""
        self._parts.pop(partition, None)

    def partitions(self) -> list[P]:
        return list(self._parts)
