"""Saving the final object of stored responses nobody is reading (a background response nobody polls or
streams, a client that left): every ``responses_sweep_s`` one ingress (the holder of a short Redis lock) looks at
the pending responses, oldest first, and derives the final object of each whose stream holds its last event,
long before the stream expires (``stream_ttl_s`` after it ends). Any ingress that sees a response end saves it
too; the sweeper is what makes a result outlive its stream when none does, and survive ingress restarts.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from sluicegate.stream_entries import parse_entry
from sluicegate.task_stop import cancel_and_wait

from ..service import IngressService
from .relay import current
from .store import ResponseStore

log = logging.getLogger(__name__)

#: Most pending responses one sweep looks at.
SWEEP_BATCH = 256
_ENDED = frozenset({"finished", "cancelled", "failed"})


class ResponseSweeper:
    """The periodic sweep, as a task of the ingress process."""

    def __init__(self, service: IngressService, store: ResponseStore) -> None:
        self._service = service
        self._store = store
        self._interval_s = service.settings.responses_sweep_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sweeping (on the running loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="responses-sweeper")

    async def close(self) -> None:
        """Stop sweeping."""
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                if await self._store.sweep_lock(self._interval_s * 0.9):
                    await self.sweep()
            except (RedisError, OSError) as exc:
                log.warning("ingress.responses_sweep_failed error=%r", exc)
            except Exception:
                log.exception("ingress.responses_sweep_crashed")

    async def sweep(self) -> int:
        """One pass; returns how many responses it saved (or found gone)."""
        pending = await self._store.pending(SWEEP_BATCH)
        done = 0
        for tenant, response_id in pending:
            stored = await self._store.get(tenant, response_id)
            if stored is None or stored.final is not None:
                await self._store.drop_pending(tenant, response_id)
                done += 1
                continue
            if not await self._ended(stored.record.request_id, stored.record.tenant):
                continue  # still queued or running: nothing to save yet
            response, final = await current(self._service, self._store, stored)
            if final:
                done += 1
                log.info("ingress.response_saved response_id=%s status=%s", response_id, response["status"])
        return done

    async def _ended(self, request_id: str, tenant: str) -> bool:
        """Whether the request's stream holds its last event; without a stream, whether its status record says it
        ended or is gone (then its result is gone too, and ``current`` says so)."""
        key = self._service.names.stream_key(request_id, tenant)
        last = await self._service.redis.xrevrange(key, count=1)
        if last:
            entry = parse_entry(key, *last[0])
            return entry is not None and entry.terminal
        record = await self._service.record(request_id, tenant)
        return record is None or record.status in _ENDED
