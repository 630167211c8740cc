"""A Redis lock with a TTL and an owner token: taken with SET NX PX, extended and released only by its owner, and
freed by itself when its holder dies (kill -9) so another batch worker carries on."""

from __future__ import annotations

import secrets

from redis.asyncio import Redis

_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"
_EXTEND = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"
)


class RedisLock:
    """One lock key; ``acquire`` does not wait (a tick that finds it taken skips: the holder is doing the work)."""

    def __init__(self, redis: Redis, key: str, *, ttl_s: float) -> None:
        self.redis = redis
        self.key = key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.token = secrets.token_hex(8)
        self._release = redis.register_script(_RELEASE)
        self._extend = redis.register_script(_EXTEND)

    async def acquire(self) -> bool:
        """Take the lock if free."""
        return bool(await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def extend(self) -> bool:
        """Renew the TTL; False when the lock was lost (expired and taken by another worker)."""
        return bool(await self._extend(keys=[self.key], args=[self.token, self.ttl_ms]))

    async def release(self) -> None:
        """Free the lock if this owner still holds it."""
        await self._release(keys=[self.key], args=[self.token])
