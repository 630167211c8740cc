"""Fencing: one owner at a time writes a request's stream and status record.

Every pick-up of a request raises its owner epoch (``Names.epoch_key``, beside the stream) in the round trip that
reads the stream's state, before the read (:func:`queue_claim`), so a write the previous owner makes after the
raise is refused and one made before it is in the state the new owner continues from. Every write a worker makes
for a request - appends, ``done``/``error``, status records, and events re-appended after a failover - goes
through one Lua script (:data:`FENCED_WRITE`) that checks the epoch the writer holds against the stored one and
refuses a stale writer as a whole. Entries carry the writer's epoch and worker id as fields of their own
(``epoch``, ``w``) beside ``event``, so the event contract is unchanged (readers take the ``event`` field).

A refused writer is a zombie: a worker paused past its group session, or cut off from Kafka but not from Redis,
whose request another worker has taken over. :class:`Fence` stops such a request at once (aborted in the
engine, which frees its KV blocks), counts it (``sluicegate_worker_fenced_total``) and logs ``worker.fenced``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from gpu_workers.engine import EngineFront
from schemas import Names

from .in_flight import InFlight

log = logging.getLogger(__name__)

#: Stream entry fields beside ``event``: the writer's owner epoch and worker id.
EPOCH_FIELD = "epoch"
WRITER_FIELD = "w"

# KEYS[1]: the request's epoch key; KEYS[2..]: the keys its ops write.
# ARGV[1]: the writer's epoch, ARGV[2]: its worker id, ARGV[3]: the TTL of a finished stream (and of the epoch key);
# then 4 values per op: kind ('a' append, 'e' append that ends the stream, 'r' status record), the index of its key
# in KEYS, then for an append its entry id and event JSON, for a record its JSON and TTL.
# Returns {0, duplicates} when written (an append whose id the stream already has is a duplicate: a replay), or
# {1, held epoch} when a newer owner holds the request: then nothing is written.
# An epoch above the stored one (the key expired, or a failover lost it) is stored, so an older writer stays out.
FENCED_WRITE = """
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[1])
if held > mine then return {1, held} end
if held < mine then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3]) end
local duplicates = 0
for i = 4, #ARGV, 4 do
  local kind, key = ARGV[i], KEYS[tonumber(ARGV[i + 1])]
  if kind == 'r' then
    redis.call('SET', key, ARGV[i + 2], 'EX', ARGV[i + 3])
  else
    local added = redis.pcall('XADD', key, ARGV[i + 2], 'event', ARGV[i + 3], 'epoch', ARGV[1], 'w', ARGV[2])
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'equal or smaller', 1, true) then return added end
      duplicates = duplicates + 1
    end
    if kind == 'e' then
      redis.call('EXPIRE', key, ARGV[3])
      redis.call('EXPIRE', KEYS[1], ARGV[3])
    end
  end
end
return {0, duplicates}
"""


class FencedOp:
    """One write of an owner: an append (``ends``: it is ``done``/``error``) or a status record."""

    __slots__ = ("a", "b", "key", "kind")

    def __init__(self, kind: str, key: str, a: str, b: str | int) -> None:
        self.kind, self.key, self.a, self.b = kind, key, a, b

    @classmethod
    def append(cls, key: str, entry_id: str, event_json: str, ends: bool) -> FencedOp:
        return cls("e" if ends else "a", key, entry_id, event_json)

    @classmethod
    def record(cls, key: str, value: str, ttl_s: int) -> FencedOp:
        return cls("r", key, value, ttl_s)


class FencedWrites:
    """The fenced-write script of one client, queued on pipelines by its SHA.

    Not redis-py's ``Script.__call__`` on a pipeline: that sends ``SCRIPT EXISTS`` before every pipeline it is in,
    a round trip more per flush. A server without the script (a restart, a failover to a replica that never loaded
    it) answers ``NOSCRIPT``; the caller then :meth:`load`\\ s it and sends the flush again.
    """

    def __init__(self, redis: aioredis.Redis, worker_id: str, ttl_s: int) -> None:
        self._script = redis.register_script(FENCED_WRITE)
        self._redis = redis
        self._worker_id = worker_id
        self._ttl_s = ttl_s

    def queue(self, pipe: Pipeline, epoch_key: str, epoch: int, ops: Sequence[FencedOp]) -> None:
        """Queue one script call writing ``ops`` in order, as the owner of ``epoch``."""
        keys = [epoch_key]
        args: list[Any] = [epoch, self._worker_id, self._ttl_s]
        for op in ops:
            if op.key not in keys:
                keys.append(op.key)
            args += [op.kind, keys.index(op.key) + 1, op.a, op.b]
        pipe.evalsha(self._script.sha, len(keys), *keys, *args)

    async def load(self) -> None:
        """Load the script into the server the client now reaches."""
        self._script.sha = await self._redis.script_load(FENCED_WRITE)


def fenced_reply(reply: Any) -> tuple[bool, int]:
    """(refused, n): refused with the epoch held now, or written with ``n`` duplicate appends."""
    return bool(int(reply[0])), int(reply[1])


def queue_claim(pipe: Pipeline, names: Names, request_id: str, tenant: str | None, ttl_s: int) -> None:
    """Queue the raise of a request's owner epoch (its reply: the new epoch), then its TTL; queued before the pick-up
    reads the stream, so that a previous owner's write lands either before the read or not at all."""
    key = names.epoch_key(request_id, tenant)
    pipe.incr(key)
    pipe.expire(key, ttl_s)


class Fence:
    """Stops requests whose writes a newer owner's epoch refused."""

    def __init__(self, engine: EngineFront, in_flight: InFlight, worker_id: str) -> None:
        self._engine = engine
        self._in_flight = in_flight
        self._worker_id = worker_id
        self._aborts: set[asyncio.Task[None]] = set()
        self.fenced = 0
        self.telemetry: Any = None  # a WorkerTelemetry, set by the Worker

    def refused(self, request_id: str, epoch: int, held: int) -> None:
        """A write of ``request_id`` as owner of ``epoch`` was refused (``held`` is the epoch now stored).

        Called from the stream publisher's flush, with no await before the flag is set: the request's task
        emits nothing more, leaves its engine loop at its next delta, and its offset is not finished here (the
        new owner finishes it)."""
        entry = self._in_flight.get(request_id)
        if entry is None or entry.epoch != epoch or entry.fenced:
            return  # already stopped, or a late write of a request this worker no longer serves
        entry.fenced = entry.handed_off = True
        self.fenced += 1
        if self.telemetry is not None:
            self.telemetry.fenced_request(entry.tier)
        log.warning(
            "worker.fenced",
            extra={"request_id": request_id, "epoch": epoch, "held_epoch": held, "worker_id": self._worker_id},
        )
        # At once, not at the task's next delta: a request waiting in the engine's queue yields none.
        task = asyncio.create_task(self._abort(entry.engine_request_ids), name=f"fenced-{request_id}")
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, engine_ids: tuple[str, ...]) -> None:
        for engine_id in engine_ids:
            with contextlib.suppress(Exception):  # already finished or aborted by its task
                await self._engine.abort(engine_id)
