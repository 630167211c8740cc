"""Per-key rate limits kept in Redis, so every ingress replica enforces the same budget.

Each limit (requests per second, requests per minute, tokens per minute) is a GCRA counter ("generic cell rate
algorithm", the leaky bucket as a single timestamp): the key holds the theoretical arrival time of the next
unit; a request of cost ``n`` is allowed when that time, advanced by ``n`` emission intervals, is at most one
period ahead of now. It smooths like a sliding window without the double burst of fixed windows, costs one
key per limit, and yields the exact wait for ``Retry-After``.

All of a request's limits are checked and charged in one Lua script: a request refused by one limit charges
none, and replicas cannot interleave between check and charge. Time comes from the Redis server's clock so
replicas agree. The script also answers what is left of each limit, which ingress sends as OpenAI's
``x-ratelimit-*`` headers (:class:`RateState`), so a client can pace itself before it meets a 429.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from redis.asyncio import Redis

from schemas import Names
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import Limits

# KEYS: one counter per limit. ARGV: period_ms, limit and cost for each, in KEYS order.
# Returns {allowed (1/0), wait_ms, then per limit: units left, ms until the counter is back to full}. Stored values
# are the theoretical arrival time (TAT) in milliseconds; a counter holds at most one period's worth of units
# ahead of now (at least one request's: a limit below 1 per period, 0.5 requests a second, still lets one through
# every 2 s), so what is left is that room over the emission interval. A refused request charges nothing, so its
# "left" is read from the unchanged TATs.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local wait = 0
local tats, steps, bursts, units = {}, {}, {}, {}
for i, key in ipairs(KEYS) do
  local period = tonumber(ARGV[3 * i - 2])
  local limit = tonumber(ARGV[3 * i - 1])
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  units[i] = limit / period
  steps[i] = tonumber(ARGV[3 * i]) / units[i]
  bursts[i] = math.max(period, steps[i])
  local allow_at = tat + steps[i] - bursts[i]
  if allow_at > now and allow_at - now > wait then wait = allow_at - now end
  tats[i] = tat
end
local allowed = 1
if wait > 0 then allowed = 0 end
local out = {allowed, math.ceil(wait)}
for i, key in ipairs(KEYS) do
  local tat = tats[i]
  if allowed == 1 then
    tat = tat + steps[i]
    redis.call('SET', key, string.format('%.3f', tat), 'PX', math.max(1, math.ceil(tat - now)))
  end
  out[2 * i + 1] = math.max(0, math.floor((now + bursts[i] - tat) * units[i] + 1e-6))
  out[2 * i + 2] = math.ceil(tat - now)
end
return out
"""


@dataclass(frozen=True)
class _Window:
    name: str
    period_ms: int
    limit: float
    cost: int
    what: str


@dataclass(frozen=True)
class WindowState:
    """What one limit has left after a request: ``remaining`` units, and ``reset_ms`` until it is back to full."""

    name: str
    limit: float
    remaining: int
    reset_ms: int


@dataclass(frozen=True)
class RateState:
    """A key's limits as one request left them, for OpenAI's ``x-ratelimit-*`` response headers."""

    windows: tuple[WindowState, ...]

    def tightest(self, other: RateState) -> RateState:
        """Per limit, the least left and the longest until whole, of this state and ``other``."""
        theirs = {w.name: w for w in other.windows}
        merged = []
        for mine in self.windows:
            if (their := theirs.get(mine.name)) is not None:
                mine = replace(
                    mine, remaining=min(mine.remaining, their.remaining), reset_ms=max(mine.reset_ms, their.reset_ms)
                )
            merged.append(mine)
        return RateState(tuple(merged))

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` as OpenAI sends them: requests from the
        per-minute limit (the per-second one when only that is set), tokens from the per-minute token limit;
        resets as Go durations ("1s", "6m0s", "20ms"), which the SDKs and OpenAI's docs use."""
        by_name = {w.name: w for w in self.windows}
        headers: dict[str, str] = {}
        for unit, window in (("requests", by_name.get("rpm") or by_name.get("rps")), ("tokens", by_name.get("tpm"))):
            if window is None:
                continue
            headers[f"x-ratelimit-limit-{unit}"] = f"{window.limit:g}"
            headers[f"x-ratelimit-remaining-{unit}"] = str(window.remaining)
            headers[f"x-ratelimit-reset-{unit}"] = go_duration(window.reset_ms)
        return headers


def go_duration(ms: int) -> str:
    """A duration in milliseconds written as Go's ``time.Duration`` does: "20ms", "1.5s", "6m0s", "1h2m3s"."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{minutes}m{seconds}"
    return seconds


#: The headers :meth:`RateState.headers` may set (CORS exposes them to browser pages).
RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{what}-{unit}" for unit in ("requests", "tokens") for what in ("limit", "remaining", "reset")
)


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

    async def acquire(self, key_id: str, limits: Limits, *, tokens: int) -> RateState | None:
        """Charge one request of ``tokens`` tokens to ``key_id``: what its limits have left (None when it has
        none). Raises ``ApiError`` 429 when over a limit (with the ``x-ratelimit-*`` headers) and
        ``RedisError``/``OSError`` when Redis does not answer."""
        windows = _windows(limits, tokens)
        if not windows:
            return None
        keys = [self._names.rate_key(key_id, w.name) for w in windows]
        args: list[float | int] = []
        for w in windows:
            args += [w.period_ms, w.limit, w.cost]
        allowed, wait_ms, *left = await self._script(keys=keys, args=args)
        state = RateState(
            tuple(WindowState(w.name, w.limit, int(left[2 * i]), int(left[2 * i + 1])) for i, w in enumerate(windows))
        )
        if int(allowed):
            return state
        retry_after = max(1, math.ceil(int(wait_ms) / 1000))
        what = " and ".join(w.what for w in windows)
        raise ApiError(
            429,
            f"Rate limit reached for this API key (limits: {what}; this request counts 1 request and {tokens} "
            f"tokens). Retry after {retry_after} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)} | state.headers(),
        )
