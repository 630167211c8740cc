"""The router's picture of what each worker's KV cache holds, built from the workers' ``KVCacheEvents``: per model and
worker a bounded set of block hashes per tier (its pool, and its host-memory and disk offload tiers), per model the
blocks written to the shared tier (any worker of the model can load them), and whether a worker's picture is
complete (in sync since a snapshot, no message lost).

A hash is kept as its first 8 bytes in an int (a collision only misroutes one request, never serves a wrong
block: the engine checks its own full hashes). Memory is bounded by ``max_blocks`` per worker and tier, and per model
for the shared tier (the oldest stored go first), and reported by ``memory_bytes``. Nothing here does I/O:
:mod:`router.kv_follower` feeds it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import KVCacheEvents, WorkerHeartbeat, utcnow

_INT64_BYTES = sys.getsizeof(1 << 63)


def short_hash(digest: bytes) -> int:
    """The index's key of a block hash: its first 8 bytes."""
    return int.from_bytes(digest[:8], "little")


def _short_hex(hex_digest: str) -> int:
    return short_hash(bytes.fromhex(hex_digest[:16]))


@dataclass
class WorkerBlocks:
    """One worker's cached blocks as the router knows them."""

    block_size: int
    seq: int
    in_sync: bool
    hashes: dict[int, None] = field(default_factory=dict)  # insertion order: the oldest stored first
    updated: float = field(default_factory=time.monotonic)
    # The worker's own offload tiers ("host", "disk"), likewise.
    tiers: dict[str, dict[int, None]] = field(default_factory=dict)


class KVIndex:
    """Per model, per worker: which block hashes its cache holds."""

    def __init__(self, max_blocks: int = 262_144) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._models: dict[str, dict[str, WorkerBlocks]] = {}
        # Per model: blocks written to the shared tier by any of its workers. The store evicts without telling:
        # this is what was written, bounded like a worker's set (the oldest forgotten first).
        self._shared: dict[str, dict[int, None]] = {}

    def apply(self, message: KVCacheEvents) -> bool:
        """Take one message in; False when the worker's picture is incomplete (joined mid-stream, or a message
        was lost): the caller asks for a snapshot, which makes it whole again."""
        workers = self._models.setdefault(message.model, {})
        known = workers.get(message.worker_id)
        if message.tier != "pool":
            return self._apply_tier(message, workers, known)
        if message.snapshot:
            known = workers[message.worker_id] = WorkerBlocks(message.block_size, message.seq, in_sync=True)
        elif known is None:
            known = workers[message.worker_id] = WorkerBlocks(message.block_size, message.seq, in_sync=False)
        else:
            if message.seq != known.seq + 1:
                known.in_sync = False
            known.seq = message.seq
            known.block_size = message.block_size
        known.updated = time.monotonic()
        if message.cleared:
            known.hashes.clear()
        self._update(known.hashes, message)
        return known.in_sync

    def _apply_tier(self, message: KVCacheEvents, workers: dict[str, WorkerBlocks], known: WorkerBlocks | None) -> bool:
        """An offload tier's message: numbered in the worker's one sequence; a snapshot replaces that tier alone (a
        worker's snapshot is its pool's message, then one per local tier, numbered one after the other)."""
        if known is None:
            known = workers[message.worker_id] = WorkerBlocks(message.block_size, message.seq, in_sync=False)
        elif message.seq != known.seq + 1:
            known.in_sync = False
        known.seq = message.seq
        known.updated = time.monotonic()
        if message.tier == "shared":
            target = self._shared.setdefault(message.model, {})
        else:
            target = known.tiers.setdefault(message.tier, {})
        if message.snapshot or message.cleared:
            target.clear()
        self._update(target, message)
        return known.in_sync

    def _update(self, hashes: dict[int, None], message: KVCacheEvents) -> None:
        for block in message.stored:
            key = _short_hex(block.hash)
            hashes.pop(key, None)  # stored again: now the newest
            hashes[key] = None
        for digest in message.removed:
            hashes.pop(_short_hex(digest), None)
        while len(hashes) > self.max_blocks:
            del hashes[next(iter(hashes))]

    def worker(self, model: str, worker_id: str) -> WorkerBlocks | None:
        return self._models.get(model, {}).get(worker_id)

    def block_size(self, model: str) -> int | None:
        """The block size the model's workers hash in (the first one known; a fleet shares one)."""
        for known in self._models.get(model, {}).values():
            return known.block_size
        return None

    def matched_blocks(self, model: str, worker_id: str, hashes: Sequence[int]) -> int:
        """How many of a prompt's leading blocks (``hashes``, from :func:`short_hash`) the worker holds."""
        known = self.worker(model, worker_id)
        if known is None:
            return 0
        held = known.hashes
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def weighted_blocks(self, model: str, worker_id: str, hashes: Sequence[int], weights: Mapping[str, float]) -> float:
        """Like :meth:`matched_blocks`, but a block the worker holds only in an offload tier (its own, or the
        model's shared one) counts its tier's weight (a load costs less than a prefill, more than a pool hit); the
        chain stops at the first block held nowhere."""
        known = self.worker(model, worker_id)
        if known is None:
            return 0.0
        places = [("pool", known.hashes), *known.tiers.items(), ("shared", self._shared.get(model, {}))]
        total = 0.0
        for h in hashes:
            weight = max((weights.get(tier, 0.0) for tier, held in places if h in held), default=0.0)
            if weight <= 0.0:
                break
            total += weight
        return total

    def fresh(self, model: str, beat: WorkerHeartbeat, *, max_lag_s: float, now: datetime | None = None) -> bool:
        """Whether the router's picture of ``beat``'s worker is complete and current: in sync, and not behind the
        seq its heartbeat reports unless that heartbeat is younger than ``max_lag_s`` (events in flight)."""
        known = self.worker(model, beat.worker_id)
        if known is None or not known.in_sync or beat.kv_events_seq is None:
            return False
        if known.seq >= beat.kv_events_seq:
            return True
        return beat.sent_at >= (now or utcnow()) - timedelta(seconds=max_lag_s)

    def forget_others(self, model: str, live: Iterable[str]) -> None:
        """Drop the workers of ``model`` not in ``live`` (gone: their blocks went with them)."""
        keep = set(live)
        workers = self._models.get(model, {})
        for worker_id in [w for w in workers if w not in keep]:
            del workers[worker_id]

    def _sets(self) -> Iterator[dict[int, None]]:
        for workers in self._models.values():
            for known in workers.values():
                yield known.hashes
                yield from known.tiers.values()
        yield from self._shared.values()

    @property
    def num_blocks(self) -> int:
        return sum(len(hashes) for hashes in self._sets())

    def memory_bytes(self) -> int:
        """What the index's hash sets take, at most: the dicts' tables plus an int of 64 bits per key (a smaller
        key takes less). Cheap enough to read at every scrape."""
        return sum(sys.getsizeof(hashes) + len(hashes) * _INT64_BYTES for hashes in self._sets())
