"""What the engine's offload tiers are given: their bounds, the disk tier's folder and the shared store's factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .tiers import BlockStore


@dataclass(frozen=True)
class KVOffloadConfig:
    """The offload tiers of one engine; each is off at 0 / None.

    ``shared_store`` builds the shared tier's client in the engine's process (a picklable factory, such as a
    ``functools.partial`` of a class with its URL): the engine runs in a child process and the client is the
    caller's, so the engine never imports a store's library itself.
    """

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    shared_store: Callable[[], BlockStore] | None = None
    # Filled blocks waiting for the writer thread, at most; past it a block is not written down (counted).
    queue_blocks: int = 1024

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "queue_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"kv_offload {name} must be an integer >= 0, got {value!r}")
        if self.queue_blocks < 1:
            raise ValueError("kv_offload queue_blocks must be >= 1")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError("kv_offload needs both disk_dir and disk_bytes > 0 for a disk tier, or neither")
        if self.shared_store is not None and not callable(self.shared_store):
            raise ValueError("kv_offload shared_store must be a callable that builds the shared tier's client")

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes or self.shared_store is not None)

    @classmethod
    def from_value(cls, value: KVOffloadConfig | dict[str, Any] | None) -> KVOffloadConfig | None:
        """The config from an instance or a dict of its fields (as ``EngineConfig`` takes it); None stays off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown kv_offload fields: {', '.join(sorted(unknown))}")
            return cls(**value)
        raise ValueError(f"kv_offload must be a KVOffloadConfig or a dict of its fields, got {value!r}")
