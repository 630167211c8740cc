"""Token quotas per API key and per tenant, per UTC day and UTC month, enforced in Redis.

A quota counts tokens (prompt + output, ``total_tokens`` of the request's usage). What a request will use is not
known when it is admitted, so admission *reserves* the most it can use, its prompt (exact when ingress counted it
with the model's tokenizer, else the estimate of :mod:`sluicegate.api.limits`) plus ``n * max_tokens``, and its
end *settles* the reservation to the real count (the usage ledger's record: the rollup settles as it counts).

Both steps are Lua scripts, so every ingress replica, router and batch worker agrees without locks:

* reserve: every counter the request is charged to (key/day, key/month, tenant/day, tenant/month, those with a
  quota) is checked, then all are charged or none; a request fits while used + reserved + its cost is at most
  the quota, so a key is stopped at the exact token. The reservation is kept under the request id (the *hold*,
  naming the counters it charged): reserving the same request again (a batch chunk or a Kafka-native record
  re-published after a crash) charges nothing twice.
* settle: the counters the hold names move by (actual - reserved) and the hold is marked settled, once; a
  second settle (a duplicate ledger record) does nothing. A release (a request that will not run: its publish
  failed) settles to 0 and forgets the hold, so the same request id is charged again if it is admitted again.

Counters live until their period ends plus a margin (a request reserved before midnight settles into the day it
was charged to) and exist only while a quota is in force: adding a quota mid-period starts counting then.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from redis.asyncio import Redis

from schemas import InferenceRequest, Names, utcnow
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import Limits, estimate_request_tokens
from sluicegate.settings import TenantQuotaSettings

Scope = Literal["key", "tenant"]
Period = Literal["day", "month"]

#: How long a counter outlives its period, so late settlements still find it.
COUNTER_MARGIN_S = 3 * 86400
#: How long a reservation is kept: past any period it could settle into.
HOLD_TTL_S = 40 * 86400

# KEYS[1]: the hold; KEYS[2..]: the counters. ARGV[1]: cost, ARGV[2]: hold TTL (s); then per counter j:
# ARGV[1 + 2j] its quota and ARGV[2 + 2j] its expiry (unix s). Returns {1} when charged (or already held for this
# request), else {0, j, used, ...} for every counter the cost does not fit into.
_RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {1} end
local cost = tonumber(ARGV[1])
local over = {0}
for j = 1, #KEYS - 1 do
  local used = tonumber(redis.call('GET', KEYS[j + 1]) or '0')
  if used + cost > tonumber(ARGV[1 + 2 * j]) then
    table.insert(over, j)
    table.insert(over, used)
  end
end
if #over > 1 then return over end
for j = 1, #KEYS - 1 do
  redis.call('INCRBY', KEYS[j + 1], cost)
  redis.call('EXPIREAT', KEYS[j + 1], ARGV[2 + 2 * j])
end
redis.call('HSET', KEYS[1], 'cost', cost, 'counters', table.concat(KEYS, '\\n', 2))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {1}
"""

# KEYS[1]: the hold; KEYS[2..]: the counters it names. ARGV[1]: the tokens really used; ARGV[2]: '1' to forget the
# hold (a release: the request id may be reserved anew), else it is kept, marked settled. Returns 1 when settled now.
_SETTLE = """
local cost = redis.call('HGET', KEYS[1], 'cost')
if not cost or redis.call('HEXISTS', KEYS[1], 'settled') == 1 then return 0 end
local delta = tonumber(ARGV[1]) - tonumber(cost)
for i = 2, #KEYS do
  if delta ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], delta) end
end
if ARGV[2] == '1' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'settled', ARGV[1])
end
return 1
"""


@dataclass(frozen=True)
class QuotaLimit:
    """One quota in force: whose (an API key's id or a tenant), over which period, how many tokens."""

    scope: Scope
    owner: str
    period: Period
    tokens: int

    def describe(self) -> str:
        whose = "this API key" if self.scope == "key" else f"tenant '{self.owner}'"
        adjective = "daily" if self.period == "day" else "monthly"
        return f"the {adjective} token quota of {whose} ({self.tokens} tokens per UTC {self.period})"


@dataclass(frozen=True)
class QuotaClaim:
    """What admitting one request charges: its reservation and the quotas it is checked against."""

    request_id: str
    cost: int
    limits: tuple[QuotaLimit, ...]


def period_label(period: Period, now: datetime) -> str:
    """The period ``now`` falls in, as it appears in counter keys: ``d20250131`` or ``m202501``."""
    return now.strftime("d%Y%m%d") if period == "day" else now.strftime("m%Y%m")


def period_end(period: Period, now: datetime) -> datetime:
    """When the period ``now`` falls in ends (UTC midnight; the first of the next month)."""
    start = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return start + timedelta(days=1)
    first = start.replace(day=1)
    return first.replace(year=first.year + 1, month=1) if first.month == 12 else first.replace(month=first.month + 1)


def tenant_quotas(settings: TenantQuotaSettings, tenant: str) -> tuple[int, int]:
    """(tokens per day, tokens per month) of a tenant: ``tenant_quotas[tenant]`` over the ``tenant_tokens_*``
    defaults; 0 means none."""
    own = settings.tenant_quotas.get(tenant, {})
    return (
        own.get("tokens_per_day", settings.tenant_tokens_per_day),
        own.get("tokens_per_month", settings.tenant_tokens_per_month),
    )


def request_cost(request: InferenceRequest, prompt_tokens: int | None = None) -> int:
    """The most tokens ``request`` can use: its prompt (``prompt_tokens`` when counted exactly, else estimated)
    plus ``max_tokens`` for each of its ``n`` choices."""
    prompt = prompt_tokens if prompt_tokens is not None else estimate_request_tokens(request)
    return prompt + request.sampling.n * request.sampling.max_tokens


def claim_for(
    request: InferenceRequest,
    settings: TenantQuotaSettings,
    *,
    key_id: str | None = None,
    key_limits: Limits | None = None,
    prompt_tokens: int | None = None,
) -> QuotaClaim | None:
    """The quota claim of admitting ``request``: the key's quotas (from ``key_limits``, when the caller is a key)
    and its tenant's (settings); None when no quota is in force for it."""
    limits: list[QuotaLimit] = []
    if key_id is not None and key_limits is not None:
        limits += [
            QuotaLimit("key", key_id, "day", key_limits.tokens_per_day),
            QuotaLimit("key", key_id, "month", key_limits.tokens_per_month),
        ]
    day, month = tenant_quotas(settings, request.tenant)
    limits += [QuotaLimit("tenant", request.tenant, "day", day), QuotaLimit("tenant", request.tenant, "month", month)]
    in_force = tuple(limit for limit in limits if limit.tokens > 0)
    if not in_force:
        return None
    return QuotaClaim(request.request_id, request_cost(request, prompt_tokens), in_force)


@dataclass(frozen=True)
class QuotaRefusal:
    """Why a request does not fit: the binding quota (the one that resets last), its use, the request's cost."""

    limit: QuotaLimit
    used: int
    cost: int
    resets_at: datetime

    def retry_after_s(self, now: datetime | None = None) -> int:
        return max(1, math.ceil((self.resets_at - (now or utcnow())).total_seconds()))

    def message(self, now: datetime | None = None) -> str:
        reset = self.resets_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        return (
            f"You exceeded your current quota: this request needs up to {self.cost} tokens (prompt + max_tokens), "
            f"and {self.limit.describe()} has {max(0, self.limit.tokens - self.used)} left. "
            f"It resets at {reset} (in {self.retry_after_s(now)} s)."
        )

    def error(self, now: datetime | None = None) -> ApiError:
        """The 429 in OpenAI's shape (``insufficient_quota``), with the reset time in ``Retry-After`` (seconds)
        and ``X-Quota-Reset`` (RFC 3339); ``x-should-retry: false`` keeps SDKs from retrying before it."""
        return ApiError(
            429,
            self.message(now),
            code="insufficient_quota",
            type_="insufficient_quota",
            headers={
                "Retry-After": str(self.retry_after_s(now)),
                "X-Quota-Reset": self.resets_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "x-should-retry": "false",
            },
        )


class Quotas:
    """Reserve, settle and read token quotas in one Redis."""

    def __init__(self, redis: Redis, names: Names) -> None:
        self._redis = redis
        self._names = names
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)

    def counter_key(self, limit: QuotaLimit, now: datetime) -> str:
        return self._names.quota_counter_key(limit.scope, limit.owner, period_label(limit.period, now))

    async def reserve(self, claim: QuotaClaim, now: datetime | None = None) -> QuotaRefusal | None:
        """Charge the claim's cost to every quota it names, or to none: None when charged (or already held for this
        request id), else the refusal. Raises ``RedisError``/``OSError`` when Redis does not answer."""
        now = now or utcnow()
        keys = [self._names.quota_hold_key(claim.request_id)]
        args: list[int] = [claim.cost, HOLD_TTL_S]
        for limit in claim.limits:
            keys.append(self.counter_key(limit, now))
            args += [limit.tokens, int(period_end(limit.period, now).timestamp()) + COUNTER_MARGIN_S]
        answer = [int(v) for v in await self._reserve(keys=keys, args=args)]
        if answer[0] == 1:
            return None
        refusals = [
            QuotaRefusal(claim.limits[j - 1], used, claim.cost, period_end(claim.limits[j - 1].period, now))
            for j, used in zip(answer[1::2], answer[2::2], strict=True)
        ]
        return max(refusals, key=lambda r: r.resets_at)

    async def settle(self, request_id: str, actual_tokens: int) -> bool:
        """Move the request's reservation to ``actual_tokens``, once; False when it has none or was settled."""
        return bool(await self.settle_many([(request_id, actual_tokens)]))

    async def release(self, request_id: str) -> bool:
        """Give back a reservation whose request will not run (its publish failed, it could not be routed) and
        forget it, so the same request id (a dead letter replayed) is charged again when it is admitted again."""
        return bool(await self.settle_many([(request_id, 0)], forget=True))

    async def settle_many(self, items: Iterable[tuple[str, int]], *, forget: bool = False) -> int:
        """Settle several requests in two round trips (the holds' counters, then the scripts); how many settled."""
        items = list(items)
        if not items:
            return 0
        read = self._redis.pipeline(transaction=False)
        for request_id, _ in items:
            read.hget(self._names.quota_hold_key(request_id), "counters")
        holds = await read.execute()
        pending = [(rid, actual, raw) for (rid, actual), raw in zip(items, holds, strict=True) if raw is not None]
        if not pending:
            return 0
        write = self._redis.pipeline(transaction=False)
        for request_id, actual, raw in pending:
            counters = raw.decode() if isinstance(raw, bytes) else str(raw)
            keys = [self._names.quota_hold_key(request_id), *counters.split("\n")]
            await self._settle(keys=keys, args=[actual, "1" if forget else "0"], client=write)
        return sum(int(v) for v in await write.execute())

    async def used(self, limit: QuotaLimit, now: datetime | None = None) -> int:
        """Tokens used or reserved against ``limit`` in the period ``now`` falls in."""
        raw = await self._redis.get(self.counter_key(limit, now or utcnow()))
        return int(raw) if raw is not None else 0
