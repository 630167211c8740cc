"""A batch's state in Redis: one hash per batch (its ``Batch`` fields, flat, plus progress), the outcome of each
resolved line in a second hash, and the indexes (per tenant, and the active batches in the order they are served).

Status moves by compare-and-set (:meth:`BatchStore.transition`), so a cancel from the API and a step of the batch
worker never overwrite each other. Line outcomes are written with HSETNX and counted in the same script, so a
result seen twice (``llm.results`` is at-least-once) is stored and counted once.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict
from redis.asyncio import Redis

from schemas import (
    BATCH_TERMINAL,
    Batch,
    BatchErrors,
    BatchRequestCounts,
    BatchUsage,
    FinalResult,
    Names,
    TraceContext,
)
from schemas.batches import InputTokensDetails
from sluicegate.settings import BatchApiSettings

from ..api.limits import Limits

#: Hash fields that hold Batch fields as JSON (the rest are plain strings or integers).
_JSON_FIELDS = ("metadata", "errors")
_INT_FIELDS = tuple(name for name in Batch.model_fields if name.endswith("_at"))
_ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

# Sets status and the given fields when the current status is one of the expected ones. KEYS[1] batch hash;
# ARGV: new status, count of expected, expected..., then field/value pairs.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local n = tonumber(ARGV[2])
for i = 3, 2 + n do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
    for j = 3 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
    return 1
  end
end
return 0
"""

# Stores line outcomes once each and counts them; optionally moves the collector's offsets in the same step.
# KEYS: offsets hash, then (batch hash, results hash) per line. ARGV: now, offset pair count, (partition, offset)*,
# then (line, outcome JSON, counter field, prompt, completion and cached tokens) per line, whose tokens add to the
# batch's usage. A line of a batch that is gone or already final is skipped.
_RESOLVE = """
local pairs_n = tonumber(ARGV[2])
local a = 3
for i = 1, pairs_n do
  redis.call('HSET', KEYS[1], ARGV[a], ARGV[a + 1])
  a = a + 2
end
local stored = 0
local completed = 0
local k = 2
while a <= #ARGV do
  local status = redis.call('HGET', KEYS[k], 'status')
  if status and status ~= 'completed' and status ~= 'failed' and status ~= 'expired' and status ~= 'cancelled' then
    if redis.call('HSETNX', KEYS[k + 1], ARGV[a], ARGV[a + 1]) == 1 then
      redis.call('HINCRBY', KEYS[k], ARGV[a + 2], 1)
      redis.call('HINCRBY', KEYS[k], 'usage_input_tokens', ARGV[a + 3])
      redis.call('HINCRBY', KEYS[k], 'usage_output_tokens', ARGV[a + 4])
      redis.call('HINCRBY', KEYS[k], 'usage_cached_tokens', ARGV[a + 5])
      redis.call('HSET', KEYS[k], 'last_result_at', ARGV[1])
      stored = stored + 1
      if ARGV[a + 2] == 'completed' then
        completed = completed + 1
      end
    end
  end
  a = a + 6
  k = k + 2
end
return {completed, stored - completed}
"""


class Resolved(NamedTuple):
    """Outcomes newly stored by one :meth:`BatchStore.resolve`, by the batch counter each went to."""

    completed: int
    failed: int

    @property
    def total(self) -> int:
        return self.completed + self.failed


class LineOutcome(BaseModel):
    """How one line ended: a worker's result, or an error the batch itself gave it.

    ``result`` with a normal finish goes to the output file; everything else to the error file: ``status_code``
    with an OpenAI error body for a request refused or failed (bad body, worker error), or no response at all
    (``no_response``) for a line the batch never ran to the end (``batch_expired``, ``batch_cancelled``).
    """

    model_config = ConfigDict(extra="forbid")

    result: FinalResult | None = None
    status_code: int = 200
    code: str | None = None
    message: str | None = None
    param: str | None = None
    no_response: bool = False

    @property
    def succeeded(self) -> bool:
        """Whether the line goes to the output file."""
        return self.result is not None and self.code is None

    @property
    def counter(self) -> Literal["completed", "failed"]:
        """The request count this outcome adds to."""
        return "completed" if self.succeeded else "failed"


def new_batch_id() -> str:
    """``batch_`` and 24 random hex characters (no ``-``: the id is the start of each line's request id)."""
    return f"batch_{secrets.token_hex(12)}"


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


class BatchStore:
    """Every batch's state; the API and the batch workers share it."""

    def __init__(self, settings: BatchApiSettings, redis: Redis, names: Names) -> None:
        self.settings = settings
        self.redis = redis
        self.names = names
        self._transition = redis.register_script(_TRANSITION)
        self._resolve = redis.register_script(_RESOLVE)

    # --- creating and reading ---------------------------------------------------------------------
    async def create(
        self,
        *,
        tenant: str,
        endpoint: str,
        input_file_id: str,
        metadata: dict[str, str] | None,
        limits: Limits,
        trace: TraceContext | None = None,
        key_id: str | None = None,
    ) -> Batch:
        """A new batch in ``validating``, listed under its tenant and among the active batches. ``trace``: the
        creating request's context, which every line's request carries (so the lines join that trace); ``key_id``:
        the creating API key's, which every line's request carries too (its usage and token quotas)."""
        now = int(time.time())
        batch = Batch(
            id=new_batch_id(),
            endpoint=endpoint,  # type: ignore[arg-type]
            input_file_id=input_file_id,
            status="validating",
            created_at=now,
            expires_at=now + self.settings.batch_window_s,
            metadata=metadata,
        )
        fields = self._fields(batch) | {"tenant": tenant, "limits": json.dumps(asdict(limits)), "enqueued": "0"}
        if trace is not None:
            fields["trace"] = trace.model_dump_json(exclude_none=True)
        if key_id is not None:
            fields["key_id"] = key_id
        key = self.names.batch_key(batch.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.zadd(self.names.batches_index_key(tenant), {batch.id: now})
            pipe.zadd(self.names.batches_active_key, {batch.id: time.time()})
            await pipe.execute()
        return batch

    @staticmethod
    def _fields(batch: Batch) -> dict[str, str]:
        fields: dict[str, str] = {}
        for name, value in batch.model_dump().items():
            if value is None or name in ("object", "request_counts", "eta_seconds"):
                continue
            fields[name] = json.dumps(value) if name in _JSON_FIELDS else str(value)
        counts = batch.request_counts
        fields |= {"total": str(counts.total), "completed": str(counts.completed), "failed": str(counts.failed)}
        return fields

    async def state(self, batch_id: str) -> dict[str, str] | None:
        """The raw hash of a batch (strings), or None."""
        raw = await self.redis.hgetall(self.names.batch_key(batch_id))
        return _decode(raw) if raw else None

    async def get(self, batch_id: str, tenant: str | None) -> Batch | None:
        """The batch if it exists and belongs to ``tenant`` (None: any tenant)."""
        state = await self.state(batch_id)
        if state is None or (tenant is not None and state.get("tenant") != tenant):
            return None
        return batch_from_state(state)

    async def list(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The tenant's batches, newest first, after the id ``after``; and whether more follow."""
        ids = [i.decode() for i in await self.redis.zrevrange(self.names.batches_index_key(tenant), 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        page = ids[: limit + 1]
        batches = [b for b in [await self.get(i, tenant) for i in page] if b is not None]
        return batches[:limit], len(batches) > limit

    async def active(self) -> list[str]:
        """Batches not yet final, oldest first (the order their lines are served and their ETAs stack)."""
        return [i.decode() for i in await self.redis.zrange(self.names.batches_active_key, 0, -1)]

    # --- moving ------------------------------------------------------------------------------------
    async def transition(self, batch_id: str, to: str, expected: tuple[str, ...], **fields: Any) -> bool:
        """Set status ``to`` (and ``<to>_at`` = now, and ``fields``) if the status is one of ``expected``."""
        stamp = {f"{to}_at": int(time.time())} if f"{to}_at" in Batch.model_fields else {}
        pairs: list[str] = []
        for name, value in (stamp | fields).items():
            pairs += [name, json.dumps(value) if name in _JSON_FIELDS else str(value)]
        done = await self._transition(
            keys=[self.names.batch_key(batch_id)], args=[to, len(expected), *expected, *pairs]
        )
        if done and to in BATCH_TERMINAL:
            await self.redis.zrem(self.names.batches_active_key, batch_id)
        return bool(done)

    async def set_fields(self, batch_id: str, **fields: Any) -> None:
        """Progress fields (no status change)."""
        mapping = {k: json.dumps(v) if k in _JSON_FIELDS else str(v) for k, v in fields.items()}
        await self.redis.hset(self.names.batch_key(batch_id), mapping=mapping)

    async def request_cancel(self, batch_id: str) -> bool:
        """Move a running batch to ``cancelling`` (the batch worker does the rest); False when it is past that."""
        return await self.transition(batch_id, "cancelling", ("validating", "in_progress"))

    # --- line outcomes ------------------------------------------------------------------------------
    async def resolve(
        self, lines: list[tuple[str, int, LineOutcome]], offsets: dict[int, int] | None = None
    ) -> Resolved:
        """Store each (batch id, line, outcome) not already stored and count it; with ``offsets`` (partition ->
        next offset of ``llm.results``) the collector's position moves in the same atomic step. Returns how many
        outcomes were new, by the counter they went to."""
        keys = [self.names.batch_collector_offsets_key]
        args: list[Any] = [int(time.time() * 1000), len(offsets or {})]
        for partition, offset in (offsets or {}).items():
            args += [partition, offset]
        for batch_id, line, outcome in lines:
            keys += [self.names.batch_key(batch_id), self.names.batch_results_key(batch_id)]
            usage = outcome.result.usage if outcome.result is not None else None
            tokens = (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if usage else (0, 0, 0)
            args += [line, outcome.model_dump_json(exclude_defaults=True), outcome.counter, *tokens]
        if len(keys) == 1 and not offsets:
            return Resolved(0, 0)
        completed, failed = await self._resolve(keys=keys, args=args)
        return Resolved(int(completed), int(failed))

    async def resolved_lines(self, batch_id: str) -> set[int]:
        """Line numbers that have an outcome."""
        return {int(k) for k in await self.redis.hkeys(self.names.batch_results_key(batch_id))}

    async def outcomes(self, batch_id: str, lines: list[int]) -> list[LineOutcome | None]:
        """The stored outcomes of ``lines`` (None where a line has none)."""
        if not lines:
            return []
        raws = await self.redis.hmget(self.names.batch_results_key(batch_id), [str(n) for n in lines])
        return [None if raw is None else LineOutcome.model_validate_json(raw) for raw in raws]


def batch_from_state(state: dict[str, str]) -> Batch:
    """The API object from a batch's hash."""
    data: dict[str, Any] = {}
    for name in Batch.model_fields:
        if name not in state or name in ("request_counts", "object", "usage"):
            continue
        value: Any = state[name]
        if name in _JSON_FIELDS:
            value = json.loads(value)
        elif name in _INT_FIELDS:
            value = int(value)
        elif name == "eta_seconds":
            value = float(value)
        data[name] = value
    counts = BatchRequestCounts(
        total=int(state.get("total", 0)), completed=int(state.get("completed", 0)), failed=int(state.get("failed", 0))
    )
    if data.get("errors") is not None:
        data["errors"] = BatchErrors.model_validate(data["errors"])
    if data.get("status") not in _ACTIVE:
        data.pop("eta_seconds", None)
    return Batch.model_validate(data | {"request_counts": counts, "usage": _usage(state)})


def _usage(state: dict[str, str]) -> BatchUsage | None:
    """The usage the resolved lines added up (None before the first line was resolved)."""
    if "usage_input_tokens" not in state:
        return None
    input_tokens, output_tokens = int(state["usage_input_tokens"]), int(state["usage_output_tokens"])
    return BatchUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=int(state.get("usage_cached_tokens", 0))),
        output_tokens=output_tokens,
        total_tokens=input_tokens + output_tokens,
    )
