"""A worker's KV offload tiers: the engine's ``KVOffloadConfig`` from the worker's settings, and the shared tier's
client: blocks in a Redis of their own, by key, which the worker hands its engine as a factory (the engine imports
no Redis client; it builds this in its own process, a process engine's child included).

Not the streams' Redis: hundreds of MB of blocks there would compete with the token streams for memory, lengthen
its snapshots and the replica acknowledgement (``WAIT``) of every append. This Redis is a cache: give it a
``maxmemory`` and ``maxmemory-policy allkeys-lru`` and it bounds and evicts by itself; losing it loses only cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import redis

from gpu_workers.engine.kv_offload import BlockStore, KVOffloadConfig
from sluicegate.settings import WorkerSettings

#: A read or write slower than this is given up (the block is recomputed, or not written): the engine's step waits.
_TIMEOUT_S = 2.0


class RedisBlockStore:
    """``BlockStore`` on redis-py's synchronous client (the engine's scheduler and writer thread call it)."""

    def __init__(self, url: str, ttl_s: int | None = None) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S)
        self.ttl_s = ttl_s

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(self.client.mget(list(keys)))

    def put(self, key: str, value: bytes) -> None:
        self.client.set(key, value, ex=self.ttl_s)


def shared_store_factory(url: str) -> partial[BlockStore] | None:
    """What ``KVOffloadConfig.shared_store`` takes for ``url`` (picklable, to reach a process engine); None when
    the URL is empty."""
    return partial(RedisBlockStore, url) if url else None


def kv_offload_config(settings: WorkerSettings) -> KVOffloadConfig | None:
    """The engine's offload tiers from the worker's settings (None when every tier is off)."""
    config = KVOffloadConfig(
        host_bytes=int(settings.kv_host_tier_gb * (1 << 30)),
        disk_dir=settings.kv_disk_tier_dir or None,
        disk_bytes=int(settings.kv_disk_tier_gb * (1 << 30)) if settings.kv_disk_tier_dir else 0,
        shared_store=shared_store_factory(settings.kv_shared_tier_url),
    )
    return config if config.enabled else None
