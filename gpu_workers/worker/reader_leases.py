"""Requests whose reader died: stop the ones relayed by an ingress instance whose reader lease lapsed.

An OpenAI-style request's output reaches its client only through the ingress instance that accepted it
(``InferenceRequest.reader``); ingress cancels the request when its client leaves, but an ingress that dies cancels
nothing, and the generation would run on for nobody. Every third of the lease, the worker asks Redis, in one
pipeline, whether the leases of the readers of the requests it holds still exist. A lease must be missing at every
check, of those Redis answered, over at least half the lease before its requests stop: a Redis that restarted
empty, or failed over to a replica a renewal had not reached, has the lease back by then, since ingress renews it
every third (a sixth of the lease to spare for a late renewal or a slow check).
"""

from __future__ import annotations

import asyncio
import logging
import time

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
        self.span_s = lease_s / 2
        # Readers whose lease the checks have found missing since, by when the first of those checks ran: missing
        # for ``span_s`` (at least two checks), their requests stop.
        self._missing: dict[str, float] = {}
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
                # Nothing is stopped on a failed read, and the misses seen so far are forgotten: a lapse is seen only
                # by reads in a row that Redis answered (it may come back empty, before a renewal).
                self._missing = {}
                log.warning("worker.reader_check_failed", extra={"error": repr(exc)})

    async def check(self) -> list[str]:
        """One check: the request ids stopped because their reader's lease has been missing for ``span_s``.

        A reader found lapsed is remembered by :class:`Cancels`, so its requests picked up later never start; it
        is looked for at every check too, and forgotten when its lease exists again."""
        held = {entry.reader for entry in self._in_flight if entry.reader is not None}
        gone = set(self._cancels.gone_readers)
        readers = sorted(held | gone)
        if not readers:
            self._missing = {}
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for reader in readers:
                pipe.exists(self._names.reader_key(reader))
            found = await pipe.execute()
        missing = frozenset(reader for reader, count in zip(readers, found, strict=True) if not count)
        for reader in gone - missing:
            log.info("worker.reader_back", extra={"reader": reader})
            self._cancels.reader_back(reader)
        now = time.monotonic()
        # A reader not asked this time (none of its requests held now: a backlog of short ones, with gaps) keeps
        # its run of misses for a lease at most, so its next request does not start the count again.
        kept = {r: since for r, since in self._missing.items() if r not in readers and now - since < 2 * self.span_s}
        self._missing = kept | {reader: self._missing.get(reader, now) for reader in missing - gone}
        lapsed = {reader for reader, since in self._missing.items() if now - since >= self.span_s and reader in missing}
        for reader in lapsed:
            del self._missing[reader]
            self._cancels.reader_gone(reader)
        # A request of a gone reader that slipped past its pick-up check stops too; not if a pick-up found the lease
        # back while this check awaited Redis (then the reader is no longer gone).
        dead = lapsed | {reader for reader in gone & missing if self._cancels.reader_is_gone(reader)}
        stopped: list[str] = []
        for entry in list(self._in_flight):
            if entry.reader in dead and not entry.cancelled:
                log.warning("worker.reader_gone", extra={"request_id": entry.request_id, "reader": entry.reader})
                await self._cancels.stop(entry, READER_GONE)
                stopped.append(entry.request_id)
        self.stopped += len(stopped)
        return stopped
