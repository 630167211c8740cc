"""The places a block goes down to, each bounded and least-recently-used: host memory (a dict of encoded blocks),
local disk (one file per block under the namespace's folder, indexed in memory and found again at start), and a
store shared by the workers of a model (any :class:`BlockStore`: the worker gives a Redis of its own).

A tier holds encoded blocks (:mod:`.codec`) by block hash and knows nothing of tensors; ``put`` answers the hashes
it dropped to make room, so the offloader can publish them as removed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

_SUFFIX = ".kvblock"


class BlockStore(Protocol):
    """A shared tier's client: bytes by key, many at once. Bounded and evicting by itself (a Redis with
    ``maxmemory`` and an LRU policy); a key it lost reads as None."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def put(self, key: str, value: bytes) -> None: ...


class HostTier:
    """Encoded blocks in this process's memory, at most ``max_bytes``; thread-safe (the writer thread puts, the
    engine's thread gets)."""

    name = "host"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            data = self._blocks.get(block_hash)
            if data is not None:
                self._blocks.move_to_end(block_hash)
            return data

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: bytes, data: bytes) -> list[bytes]:
        if len(data) > self.max_bytes:
            return []
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self._bytes -= len(old)
            self._blocks[block_hash] = data
            self._bytes += len(data)
            dropped = []
            while self._bytes > self.max_bytes:
                h, gone = self._blocks.popitem(last=False)
                self._bytes -= len(gone)
                dropped.append(h)
            return dropped

    def discard(self, block_hash: bytes) -> bool:
        with self._lock:
            gone = self._blocks.pop(block_hash, None)
            if gone is not None:
                self._bytes -= len(gone)
            return gone is not None

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    @property
    def used_bytes(self) -> int:
        return self._bytes


class DiskTier:
    """One file per block under ``root/<namespace hex>/``, at most ``max_bytes`` in all, least recently used
    removed first. Files are written to a temporary name and renamed, so a reader (or a restart after ``kill -9``)
    sees a whole file or none; what a crash or a disk still damages, the codec's checksum refuses. The files found
    at start (oldest modification first) are the tier's content, so a restarted worker serves and publishes them."""

    name = "disk"

    def __init__(self, root: str | Path, namespace: bytes, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.folder = Path(root) / namespace.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        found = []
        for path in self.folder.glob(f"*{_SUFFIX}"):
            try:
                stat = path.stat()
                found.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
            except (OSError, ValueError):
                continue  # a stray file: not a block of ours
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
            self._bytes += size
        for stale in self.folder.glob("*.tmp"):
            stale.unlink(missing_ok=True)  # a write cut short by a crash
        self._shrink()

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / (block_hash.hex() + _SUFFIX)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            if block_hash not in self._files:
                return None
            self._files.move_to_end(block_hash)
        try:
            return self._path(block_hash).read_bytes()
        except OSError:
            self.discard(block_hash)
            return None

    def put(self, block_hash: bytes, data: bytes) -> list[bytes]:
        if len(data) > self.max_bytes:
            return []
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("kv_offload.disk_write_failed", extra={"error": repr(exc)})
            return []
        with self._lock:
            self._bytes -= self._files.pop(block_hash, 0)
            self._files[block_hash] = len(data)
            self._bytes += len(data)
        return self._shrink()

    def _shrink(self) -> list[bytes]:
        dropped = []
        with self._lock:
            while self._bytes > self.max_bytes and self._files:
                h, size = self._files.popitem(last=False)
                self._bytes -= size
                dropped.append(h)
        for h in dropped:
            self._path(h).unlink(missing_ok=True)
        return dropped

    def discard(self, block_hash: bytes) -> bool:
        """Forget a block (damaged, unreadable) and delete its file."""
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
        self._path(block_hash).unlink(missing_ok=True)
        return size is not None

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._files)

    @property
    def used_bytes(self) -> int:
        return self._bytes


class SharedTier:
    """A :class:`BlockStore` under the namespace's key prefix. The store bounds and evicts by itself, silently:
    its events say what was written, not what it dropped since."""

    name = "shared"

    def __init__(self, store: BlockStore, namespace: bytes) -> None:
        self.store = store
        self.prefix = f"sluicegate:kv:{namespace.hex()}:"

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        if not block_hashes:
            return []
        return self.store.get_many([self.prefix + h.hex() for h in block_hashes])

    def put(self, block_hash: bytes, data: bytes) -> list[bytes]:
        self.store.put(self.prefix + block_hash.hex(), data)
        return []
