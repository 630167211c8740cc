"""Cancels: the control-topic loop, cancels that arrive before their request, and the check at pick-up.

A cancel on ``llm.control`` for a request this worker holds aborts its engine sequence at once; one for a
request not (yet) here is remembered, so the request is never run if it arrives later. The Redis cancel
marker, read with the pickup state, covers cancels sent before this worker was listening.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from aiokafka import AIOKafkaConsumer
from pydantic import ValidationError

from gpu_workers.engine import EngineFront
from schemas import CancelRequest

from .in_flight import Active, InFlight

log = logging.getLogger(__name__)

# Cancels remembered for requests not picked up yet; the oldest are dropped past this many.
EARLY_CANCELS_KEPT = 10_000
# Readers (ingress instances) whose lease lapsed, remembered so their queued requests never start, for this long
# and at most this many (each ingress process has a reader id of its own, so dead ones accumulate; a request of
# one forgotten still stops, once the reader watch sees its lease missing for half of it).
GONE_READERS_KEPT = 1_000
GONE_READERS_KEPT_S = 3600.0


class Cancels:
    """Reads ``llm.control`` and answers whether a request was cancelled."""

    def __init__(self, consumer: AIOKafkaConsumer, engine: EngineFront, in_flight: InFlight) -> None:
        self.consumer = consumer
        self.engine = engine
        self.in_flight = in_flight
        # Cancels that arrived before their request was picked up (bounded, oldest dropped).
        self._early: OrderedDict[str, None] = OrderedDict()
        # Readers whose lease lapsed (``reader_leases.ReaderWatch``), with when: nobody reads what their requests make.
        self._gone_readers: OrderedDict[str, float] = OrderedDict()

    def pending(self, request_id: str, reader: str | None = None) -> bool:
        """Whether a cancel for ``request_id`` arrived before the request did, or its reader is gone."""
        return request_id in self._early or self.reader_is_gone(reader)

    def requested(self, entry: Active, cancel_marked: bool) -> bool:
        """A cancel seen on the control topic (before or after pick-up) or marked in Redis, or its reader gone."""
        rid = entry.request_id
        if rid in self._early:
            del self._early[rid]
            entry.cancelled = True
        if self.reader_is_gone(entry.reader):
            entry.cancelled = True
        return entry.cancelled or cancel_marked

    @property
    def gone_readers(self) -> list[str]:
        """The readers whose lease lapsed and has not come back (those remembered longer than
        ``GONE_READERS_KEPT_S`` are forgotten here)."""
        horizon = time.monotonic() - GONE_READERS_KEPT_S
        while self._gone_readers and next(iter(self._gone_readers.values())) < horizon:
            self._gone_readers.popitem(last=False)
        return list(self._gone_readers)

    def reader_is_gone(self, reader: str | None) -> bool:
        """Whether ``reader``'s lease was seen lapsed and not back since (never for a request naming none)."""
        return reader is not None and reader in self._gone_readers

    def reader_gone(self, reader: str) -> None:
        """Remember a lapsed reader: its requests picked up from now on are never started."""
        self._gone_readers[reader] = time.monotonic()
        self._gone_readers.move_to_end(reader)
        while len(self._gone_readers) > GONE_READERS_KEPT:
            self._gone_readers.popitem(last=False)

    def reader_back(self, reader: str) -> None:
        """A lapsed reader's lease exists again (the same ingress renewed it): its requests run again."""
        self._gone_readers.pop(reader, None)

    async def run(self) -> None:
        async for message in self.consumer:
            try:
                cancel = CancelRequest.model_validate_json(message.value)
            except ValidationError:
                log.warning("worker.bad_control_message", extra={"offset": message.offset})
                continue
            entry = self.in_flight.get(cancel.request_id)
            if entry is None:
                self._early[cancel.request_id] = None
                while len(self._early) > EARLY_CANCELS_KEPT:
                    self._early.popitem(last=False)
                continue
            await self.stop(entry, cancel.reason)

    async def stop(self, entry: Active, reason: str) -> None:
        """Cancel a request this worker holds: never started if it has not been, aborted in the engine if it runs."""
        log.info("worker.cancel", extra={"request_id": entry.request_id, "reason": reason})
        entry.cancelled = True
        for engine_id in entry.engine_request_ids:
            await self.engine.abort(engine_id)
