"""Stored responses in Redis, per tenant: a hash per response (``Names.response_key``) holding its ``record``
(fixed at creation: the request, its input items, the conversation chain), its ``final`` response object once it
ended, and ``cancel`` once a cancel was asked for; all of it expires ``responses_ttl_s`` after creation. A sorted
set (``Names.responses_pending_key``) lists the stored responses whose final object is not saved yet, for the
sweeper (:mod:`.sweeper`).

A key holds its tenant, so another tenant's id is simply not found. Writes to an existing hash (final, cancel)
go through a script that does nothing when the hash is gone, so a response deleted meanwhile never comes back
without an expiry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from schemas import Names
from sluicegate.api.errors import ApiError
from sluicegate.settings import IngressSettings

from .objects import ResponseRecord

# KEYS[1] the response hash, KEYS[2] the pending set; ARGV[1] field, ARGV[2] value, ARGV[3] pending member
# (empty: leave the set alone). Sets the field only on a hash that still exists.
_SET_IF_EXISTS = """
if redis.call('exists', KEYS[1]) == 1 then redis.call('hset', KEYS[1], ARGV[1], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('zrem', KEYS[2], ARGV[3]) end
return 1
"""


@dataclass(frozen=True)
class Stored:
    """A stored response as Redis holds it now."""

    record: ResponseRecord
    final: dict[str, Any] | None
    cancel_requested: bool


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """The one answer for a response that is missing, expired, deleted or another tenant's."""
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found", param=param)


def _member(tenant: str, response_id: str) -> str:
    return f"{tenant} {response_id}"


class ResponseStore:
    """Reads and writes stored responses."""

    def __init__(self, settings: IngressSettings, redis: Redis, names: Names) -> None:
        self._settings = settings
        self._redis = redis
        self._names = names
        self._set_if_exists = redis.register_script(_SET_IF_EXISTS)

    async def create(self, record: ResponseRecord) -> None:
        """Store a new response and list it as pending."""
        key = self._names.response_key(record.tenant, record.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, "record", record.model_dump_json())
            pipe.expire(key, self._settings.responses_ttl_s)
            pipe.zadd(self._names.responses_pending_key, {_member(record.tenant, record.id): record.created_at})
            await pipe.execute()

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's stored response, or None."""
        (found,) = await self.get_many(tenant, [response_id])
        return found

    async def get_many(self, tenant: str, response_ids: list[str]) -> list[Stored | None]:
        """The tenant's stored responses, in one round trip (None for each one missing)."""
        if not response_ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for response_id in response_ids:
                pipe.hmget(self._names.response_key(tenant, response_id), ["record", "final", "cancel"])
            replies = await pipe.execute()
        return [_stored(reply) for reply in replies]

    async def finalize(self, record: ResponseRecord, response: dict[str, Any]) -> None:
        """Save the final response object and take the response off the pending set."""
        await self._set_if_exists(
            keys=[self._names.response_key(record.tenant, record.id), self._names.responses_pending_key],
            args=["final", json.dumps(response, separators=(",", ":")), _member(record.tenant, record.id)],
        )

    async def mark_cancelled(self, record: ResponseRecord) -> None:
        """Remember that a cancel was asked for (the status reads ``cancelled`` until the stream ends)."""
        await self._set_if_exists(
            keys=[self._names.response_key(record.tenant, record.id), self._names.responses_pending_key],
            args=["cancel", "1", ""],
        )

    async def delete(self, record: ResponseRecord) -> None:
        """Forget a response."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._names.response_key(record.tenant, record.id))
            pipe.zrem(self._names.responses_pending_key, _member(record.tenant, record.id))
            await pipe.execute()

    # --- the sweeper's view ----------------------------------------------------------------------------
    async def pending(self, limit: int) -> list[tuple[str, str]]:
        """The oldest pending responses, as ``(tenant, response id)``."""
        members = await self._redis.zrange(self._names.responses_pending_key, 0, limit - 1)
        out = []
        for member in members:
            tenant, _, response_id = (member.decode() if isinstance(member, bytes) else member).partition(" ")
            out.append((tenant, response_id))
        return out

    async def drop_pending(self, tenant: str, response_id: str) -> None:
        """Take a response off the pending set (it is gone, or final)."""
        await self._redis.zrem(self._names.responses_pending_key, _member(tenant, response_id))

    async def sweep_lock(self, hold_s: float) -> bool:
        """Whether this process won the right to sweep for the next ``hold_s`` seconds."""
        taken = await self._redis.set(
            self._names.responses_sweep_lock_key, b"1", px=max(1, int(hold_s * 1000)), nx=True
        )
        return bool(taken)


def _stored(reply: list[Any]) -> Stored | None:
    raw, final, cancel = reply
    if raw is None:
        return None
    return Stored(
        record=ResponseRecord.model_validate_json(raw),
        final=json.loads(final) if final is not None else None,
        cancel_requested=cancel is not None,
    )
