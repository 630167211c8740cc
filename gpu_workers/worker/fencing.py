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

# One call writes a whole flush: every request's writes, each request as the owner of its epoch.
# KEYS: every key the call reads or writes. ARGV[1]: the writer's worker id, ARGV[2]: the TTL of a finished stream
# (and of its epoch key); then per request: the index in KEYS of its epoch key, its epoch, its number of ops, and
# 4 values per op: kind ('a' append, 'e' append that ends the stream, 'r' status record), the index of its key in
# KEYS, then for an append its entry id and event JSON, for a record its JSON and TTL.
# Returns one number per request: the appends refused as duplicates (an id the stream already has: a replay) when
# written, or minus the epoch held now when a newer owner holds the request (then none of its writes is made).
# An epoch above the stored one (the key expired, or a failover lost it) is stored, so an older writer stays out.
# One call per flush rather than per request: each command costs the worker's event loop its packing and reply.
# Keys of many requests in one script: fine on one primary (Sentinel), not on Redis Cluster.
FENCED_WRITE = """
local out = {}
local i = 3
while i <= #ARGV do
  local epoch_key = KEYS[tonumber(ARGV[i])]
  local mine = tonumber(ARGV[i + 1])
  local ops = tonumber(ARGV[i + 2])
  i = i + 3
  local held = tonumber(redis.call('GET', epoch_key) or '0')
  if held > mine then
    out[#out + 1] = -held
  else
    if held < mine then redis.call('SET', epoch_key, ARGV[i - 2], 'EX', ARGV[2]) end
    local duplicates = 0
    for j = i, i + 4 * (ops - 1), 4 do
      local kind, key = ARGV[j], KEYS[tonumber(ARGV[j + 1])]
      if kind == 'r' then
        redis.call('SET', key, ARGV[j + 2], 'EX', ARGV[j + 3])
      else
        local added = redis.pcall('XADD', key, ARGV[j + 2], 'event', ARGV[j + 3], 'epoch', ARGV[i - 2], 'w', ARGV[1])
        if type(added) == 'table' and added.err then
          if not string.find(added.err, 'equal or smaller', 1, true) then return added end
          duplicates = duplicates + 1
        end
        if kind == 'e' then
          redis.call('EXPIRE', key, ARGV[2])
          redis.call('EXPIRE', epoch_key, ARGV[2])
        end
      end
    end
    out[#out + 1] = duplicates
  end
  i = i + 4 * ops
end
return out
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

    def queue(self, pipe: Pipeline, owners: Sequence[tuple[str, int, Sequence[FencedOp]]]) -> None:
        """Queue one script call writing, for each ``(epoch key, epoch, ops)``, its ops in order as the owner of that
        epoch. Its reply, read with :func:`fenced_replies`, has one number per owner."""
        keys: dict[str, int] = {}

        def index(key: str) -> int:
            return keys.setdefault(key, len(keys) + 1)

        args: list[Any] = [self._worker_id, self._ttl_s]
        for epoch_key, epoch, ops in owners:
            args += [index(epoch_key), epoch, len(ops)]
            for op in ops:
                args += [op.kind, index(op.key), op.a, op.b]
        pipe.evalsha(self._script.sha, len(keys), *keys, *args)

    async def load(self) -> None:
        """Load the script into the server the client now reaches."""
        self._script.sha = await self._redis.script_load(FENCED_WRITE)


def fenced_replies(reply: Any) -> list[tuple[bool, int]]:
    """Per owner of a script call: (refused, n), refused with ``n`` the epoch held now, or written with ``n``
    duplicate appends."""
    return [(int(n) < 0, abs(int(n))) for n in reply]


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
