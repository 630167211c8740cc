"""The engine's side of the offload tiers: full blocks copied out as they fill and written down by a background
thread, and a prefix lookup that missed the pool served from the tiers, fastest first.

Writing on fill (not on eviction) costs a copy of each new block's K/V, but a worker killed with ``kill -9`` leaves
its hot prefixes on disk and in the shared store. The copy goes to a bounded queue on the engine's thread; encoding
and the writes happen on the writer thread, so a slow disk or store never holds a step back (a full queue drops the
block, counted). Loading is synchronous in the scheduler's lookup: the blocks must be in the pool before the step
that reads them, and a load is far cheaper than the prefill it replaces.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .codec import BlockDamaged, decode_block, encode_block
from .config import KVOffloadConfig
from .tiers import DiskTier, HostTier, SharedTier

log = logging.getLogger(__name__)

TIERS = ("host", "disk", "shared")
_STOP = None


@dataclass
class OffloadStats:
    """Counters of the tiers since the engine started (per tier name)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_loaded: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_written: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    load_seconds: float = 0.0
    loads: int = 0
    damaged: int = 0
    dropped: int = 0
    write_errors: int = 0


#: One tier's changes since the last take: blocks stored ``(hash, parent)`` and removed.
TierEvents = tuple[list[tuple[bytes, bytes]], list[bytes]]


class KVOffloader:
    """Writes filled blocks down and loads prefixes back for one engine's KV cache.

    ``namespace`` answers the configuration's namespace (:func:`.namespace.tier_namespace`), or None while it is not
    known yet (an FP8 cache before its scales are fixed): nothing is written or read until it is.
    """

    def __init__(self, config: KVOffloadConfig, kv_cache: torch.Tensor, namespace: Callable[[], bytes | None]) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.block_shape = tuple(kv_cache[:, :, 0].shape)
        self.dtype = kv_cache.dtype
        self._namespace_fn = namespace
        self._namespace: bytes | None = None
        self.host = HostTier(config.host_bytes) if config.host_bytes else None
        self.disk: DiskTier | None = None
        self.shared: SharedTier | None = None
        self.stats = OffloadStats()
        self.record_events = False
        self._events: dict[str, TierEvents] = {}
        self._events_lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, bytes, torch.Tensor] | None] = queue.Queue(config.queue_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()
        self._resolve()

    # ------------------------------------------------------------------ namespace
    def _resolve(self) -> bytes | None:
        if self._namespace is None:
            namespace = self._namespace_fn()
            if namespace is None:
                return None
            if self.config.disk_dir is not None:
                self.disk = DiskTier(self.config.disk_dir, namespace, self.config.disk_bytes)
            if self.config.shared_store is not None:
                self.shared = SharedTier(self.config.shared_store(), namespace)
            self._namespace = namespace
        return self._namespace

    @property
    def namespace(self) -> bytes | None:
        return self._namespace

    # ------------------------------------------------------------------ writing down
    def block_filled(self, block_hash: bytes, parent: bytes, block_id: int) -> None:
        """A block just became full of computed K/V: copy it out for the writer (engine thread, cheap)."""
        if self._resolve() is None or self._written(block_hash):
            return
        kv = self.kv_cache[:, :, block_id].to("cpu", copy=True)
        try:
            self._queue.put_nowait((block_hash, parent, kv))
        except queue.Full:
            self.stats.dropped += 1

    def _written(self, block_hash: bytes) -> bool:
        """Already down in the first tier a write reaches (it went to the others with it)."""
        first = self.host or self.disk
        return first is not None and block_hash in first

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(*item)
            except Exception:  # the writer must outlive one bad write; the block is simply not down
                self.stats.write_errors += 1
                log.exception("kv_offload.write_failed")
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, parent: bytes, kv: torch.Tensor) -> None:
        assert self._namespace is not None
        data = encode_block(self._namespace, block_hash, kv)
        for tier in (self.host, self.disk, self.shared):
            if tier is None:
                continue
            try:
                dropped = tier.put(block_hash, data)
            except Exception as exc:  # a store that is down loses this write only
                self.stats.write_errors += 1
                log.warning("kv_offload.write_failed", extra={"tier": tier.name, "error": repr(exc)})
                continue
            self.stats.bytes_written[tier.name] += len(data)
            self._journal(tier.name, [(block_hash, parent)], dropped)

    def _journal(self, tier: str, stored: list[tuple[bytes, bytes]], removed: list[bytes]) -> None:
        if not self.record_events or not (stored or removed):
            return
        with self._events_lock:
            had_stored, had_removed = self._events.setdefault(tier, ([], []))
            had_stored.extend(stored)
            had_removed.extend(removed)

    # ------------------------------------------------------------------ loading back
    def fetch_prefix(self, block_hashes: Sequence[bytes]) -> list[torch.Tensor]:
        """The K/V of the leading ``block_hashes`` the tiers hold, checked, fastest tier first; stops at the first
        block no tier holds whole (a damaged one is dropped from its tier and counted)."""
        if not block_hashes or self._resolve() is None:
            return []
        start = time.perf_counter()
        found: list[tuple[str, bytes]] = []
        for block_hash in block_hashes:
            data, tier = self._local(block_hash)
            if data is None:
                break
            found.append((tier, data))
        if self.shared is not None and len(found) < len(block_hashes):
            try:
                rest = self.shared.get_many(block_hashes[len(found) :])
            except Exception as exc:  # the store is down: recompute
                log.warning("kv_offload.shared_read_failed", extra={"error": repr(exc)})
                rest = []
            for data in rest:
                if data is None:
                    break
                found.append(("shared", data))
        loaded: list[torch.Tensor] = []
        for block_hash, (tier, data) in zip(block_hashes, found, strict=False):
            try:
                kv = decode_block(data, self._namespace or b"", block_hash, self.block_shape, self.dtype)
            except BlockDamaged as exc:
                self.stats.damaged += 1
                log.warning("kv_offload.block_damaged", extra={"tier": tier, "error": str(exc)})
                self._drop(tier, block_hash)
                break
            self.stats.hits[tier] += 1
            self.stats.bytes_loaded[tier] += len(data)
            if tier != "host" and self.host is not None:
                self._journal("host", [(block_hash, b"")], self.host.put(block_hash, data))
            loaded.append(kv)
        if found:
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
        return loaded

    def _local(self, block_hash: bytes) -> tuple[bytes | None, str]:
        for tier in (self.host, self.disk):
            if tier is not None:
                data = tier.get(block_hash)
                if data is not None:
                    return data, tier.name
        return None, ""

    def _drop(self, tier: str, block_hash: bytes) -> None:
        local = {"host": self.host, "disk": self.disk}.get(tier)
        if local is not None and local.discard(block_hash):
            self._journal(tier, [], [block_hash])

    def load_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Put a fetched block's K/V into pool block ``block_id``."""
        self.kv_cache[:, :, block_id].copy_(kv)

    # ------------------------------------------------------------------ events and lifetime
    def take_events(self) -> dict[str, TierEvents]:
        """Each tier's stored and removed blocks since the last call (tiers without changes left out)."""
        with self._events_lock:
            events, self._events = self._events, {}
        return events

    def snapshot(self) -> dict[str, list[bytes]]:
        """What the local tiers hold now (the shared store is not listed: it is the fleet's, not this worker's);
        the journal restarts from here."""
        with self._events_lock:
            self._events = {}
        return {tier.name: tier.hashes() for tier in (self.host, self.disk) if tier is not None}

    def stats_snapshot(self) -> OffloadStats:
        """A copy of the counters (the writer thread keeps adding to the live ones)."""
        s = self.stats
        return OffloadStats(
            dict(s.hits), dict(s.bytes_loaded), dict(s.bytes_written),
            s.load_seconds, s.loads, s.damaged, s.dropped, s.write_errors,
        )  # fmt: skip

    def flush(self) -> None:
        """Wait until every block queued so far is written down."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join(timeout=10)
