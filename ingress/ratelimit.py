"""Per-key rate limits kept in Redis, so every ingress replica enforces the same budget.

Each limit (requests per second, requests per minute, tokens per minute) is a GCRA counter ("generic cell rate
algorithm", the leaky bucket as a single timestamp): the key holds the theoretical arrival time of the next
unit; a request of cost ``n`` is allowed when that time, advanced by ``n`` emission intervals, is at most one
period ahead of now. It smooths like a sliding window without the double burst of fixed windows, costs one
key per limit, and yields the exact wait for ``Retry-After``.

All of a request's limits are checked and charged in one Lua script: a request refused by one limit charges
none, and replicas cannot interleave between check and charge. Time comes from the Redis server's clock so
replicas agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from schemas import Names
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import Limits

# KEYS: one counter per limit. ARGV: period_ms, limit and cost for each, in KEYS order.
# Returns {allowed (1/0), wait_ms}. Stored values are the theoretical arrival time in milliseconds.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local wait = 0
local tats = {}
for i, key in ipairs(KEYS) do
  local period = tonumber(ARGV[3 * i - 2])
  local limit = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * period / limit
  local allow_at = new_tat - period
  if allow_at > now and allow_at - now > wait then wait = allow_at - now end
  tats[i] = new_tat
end
if wait > 0 then return {0, math.ceil(wait)} end
for i, key in ipairs(KEYS) do
  redis.call('SET', key, string.format('%.3f', tats[i]), 'PX', math.max(1, math.ceil(tats[i] - now)))
end
return {1, 0}
"""


@dataclass(frozen=True)
class _Window:
    name: str
    period_ms: int
    limit: float
    cost: int
    what: str


def _windows(limits: Limits, tokens: int) -> list[_Window]:
    windows = [
        _Window("rps", 1000, limits.rps, 1, f"{limits.rps:g} requests per second"),
        _Window("rpm", 60_000, limits.rpm, 1, f"{limits.rpm} requests per minute"),
        _Window("tpm", 60_000, limits.tpm, tokens, f"{limits.tpm} tokens per minute"),
    ]
    return [w for w in windows if w.limit > 0 and w.cost > 0]


class RateLimiter:
    """Charges requests against their key's limits; a request over any of them is a 429 with Retry-After."""

    def __init__(self, redis: Redis, names: Names) -> None:
        self._names = names
        self._script = redis.register_script(_GCRA)

    async def acquire(self, key_id: str, limits: Limits, *, tokens: int) -> None:
        """Charge one request of ``tokens`` tokens to ``key_id``; raises ``ApiError`` 429 when over a limit and
        ``RedisError``/``OSError`` when Redis does not answer."""
        windows = _windows(limits, tokens)
        if not windows:
            return
        keys = [self._names.rate_key(key_id, w.name) for w in windows]
        args: list[float | int] = []
        for w in windows:
            args += [w.period_ms, w.limit, w.cost]
        allowed, wait_ms = await self._script(keys=keys, args=args)
        if int(allowed):
            return
        retry_after = max(1, math.ceil(int(wait_ms) / 1000))
        what = " and ".join(w.what for w in windows)
        raise ApiError(
            429,
            f"Rate limit reached for this API key (limits: {what}; this request counts 1 request and {tokens} "
            f"tokens). Retry after {retry_after} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )
