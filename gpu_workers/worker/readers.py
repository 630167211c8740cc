"""Requests whose reader died: stop the ones relayed by an ingress instance whose reader lease lapsed.

An OpenAI-style request's output reaches its client only through the ingress instance that accepted it
(``InferenceRequest.reader``); ingress cancels the request when its client leaves, but an ingress that dies cancels
nothing, and the generation would run on for nobody. Every third of the lease, the worker asks Redis, in one
pipeline, whether the leases of the readers of the requests it holds still exist. A lease must be missing at two
checks in a row, at least a third of the lease apart, before its requests stop: a Redis that restarted empty, or
failed over to a replica a renewal had not reached, has the lease back by then (ingress renews it every third).
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from schemas import Names

from .control import Cancels
from .in_flight import InFlight

log = logging.getLogger(__name__)

#: The reason the stopped requests' cancels carry (logs).
READER_GONE = "reader_gone"


class ReaderWatch:
    """Looks for lapsed reader leases and cancels their requests (through :meth:`Cancels.stop`)."""

    def __init__(
        self, redis: aioredis.Redis, names: Names, in_flight: InFlight, cancels: Cancels, lease_s: float
    ) -> None:
        self._redis = redis
        self._names = names
        self._in_flight = in_flight
        self._cancels = cancels
        self.interval_s = lease_s / 3
        # Readers whose lease the last check found missing: a second miss stops their requests.
        self._missing: frozenset[str] = frozenset()
        self.stopped = 0  # requests stopped because their reader was gone (logs, tests)

    @property
    def enabled(self) -> bool:
        """False when leases are off (``reader_lease_s`` 0)."""
        return self.interval_s > 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except (RedisError, OSError) as exc:
                # Nothing is stopped on a failed read, and the misses seen so far are forgotten: two misses must
                # come from two reads in a row that Redis answered (it may come back empty, before a renewal).
                self._missing = frozenset()
                log.warning("worker.reader_check_failed", extra={"error": repr(exc)})

    async def check(self) -> list[str]:
        """One check: the request ids stopped because their reader's lease was missing now and at the last check.

        A reader found lapsed is remembered by :class:`Cancels`, so its requests picked up later never start; it
        is looked for at every check too, and forgotten when its lease exists again."""
        held = {entry.reader for entry in self._in_flight if entry.reader is not None}
        gone = set(self._cancels.gone_readers)
        readers = sorted(held | gone)
        if not readers:
            self._missing = frozenset()
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for reader in readers:
                pipe.exists(self._names.reader_key(reader))
            found = await pipe.execute()
        missing = frozenset(reader for reader, count in zip(readers, found, strict=True) if not count)
        for reader in gone - missing:
            log.info("worker.reader_back", extra={"reader": reader})
            self._cancels.reader_back(reader)
        lapsed = (missing & self._missing) - gone
        self._missing = missing - gone
        for reader in lapsed:
            self._cancels.reader_gone(reader)
        dead = lapsed | (gone & missing)  # a request of a gone reader that slipped past its pick-up check stops too
        stopped: list[str] = []
        for entry in list(self._in_flight):
            if entry.reader in dead and not entry.cancelled:
                log.warning("worker.reader_gone", extra={"request_id": entry.request_id, "reader": entry.reader})
                await self._cancels.stop(entry, READER_GONE)
                stopped.append(entry.request_id)
        self.stopped += len(stopped)
        return stopped
