"""Cancels: the control-topic loop, cancels that arrive before their request, and the check at pick-up.

A cancel on ``llm.control`` for a request this worker holds aborts its engine sequence at once; one for a
request not (yet) here is remembered, so the request is never run if it arrives later. The Redis cancel
marker, read with the pickup state, covers cancels sent before this worker was listening.

With tenants apart each tenant has its own control topic, which only its principal and the services may write:
a cancel read there stops only that tenant's request (the tenant is the topic's, as the router takes an inbound
record's), so one tenant cannot cancel another's by naming its request id. A cancel field naming the tenant would
not do: whoever writes the message writes the field. ``llm.control`` itself stays the services' and may cancel any.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from aiokafka import AIOKafkaConsumer
from pydantic import ValidationError

from gpu_workers.engine import EngineFront
from schemas import CancelRequest, KVSnapshotRequest, Names

from .in_flight import Active, InFlight
from .kv_events import KVEventPublisher

log = logging.getLogger(__name__)

# Cancels remembered for requests not picked up yet; the oldest are dropped past this many.
EARLY_CANCELS_KEPT = 10_000
# Readers (ingress instances) whose lease lapsed, remembered so their queued requests never start, for this long
# and at most this many (each ingress process has a reader id of its own, so dead ones accumulate; a request of
# one forgotten still stops, once the reader watch sees its lease missing for half of it).
GONE_READERS_KEPT = 1_000
GONE_READERS_KEPT_S = 3600.0


def control_topics(names: Names, tenants: tuple[str, ...] = ()) -> dict[str, str | None]:
    """The control topics a worker reads, each with the tenant whose requests it may cancel (None: any)."""
    topics: dict[str, str | None] = {names.control_topic: None}
    if names.tenants_apart:
        topics |= {names.control_topic_of(tenant): tenant for tenant in tenants}
    return topics


class Cancels:
    """Reads the control topics and answers whether a request was cancelled."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        engine: EngineFront,
        in_flight: InFlight,
        topics: dict[str, str | None] | None = None,
    ) -> None:
        self.consumer = consumer
        self.engine = engine
        self.in_flight = in_flight
        # Each control topic's tenant (see :func:`control_topics`); a topic not named here may cancel any request.
        self._tenant_of = topics or {}
        # Cancels that arrived before their request was picked up, with the tenants of the topics they came on
        # (bounded, oldest dropped): a set, so another tenant's cancel of the same id cannot replace a rightful one.
        self._early: OrderedDict[str, set[str | None]] = OrderedDict()
        # Readers whose lease lapsed (``reader_leases.ReaderWatch``), with when: nobody reads what their requests make.
        self._gone_readers: OrderedDict[str, float] = OrderedDict()
        # Where a ``KVSnapshotRequest`` read here goes (set by the Worker when it publishes KV events).
        self.kv_events: KVEventPublisher | None = None

    def pending(self, request_id: str, reader: str | None = None) -> bool:
        """Whether a cancel for ``request_id`` arrived before the request did, or its reader is gone."""
        return request_id in self._early or self.reader_is_gone(reader)

    def requested(self, entry: Active, cancel_marked: bool) -> bool:
        """A cancel seen on the control topic (before or after pick-up) or marked in Redis, or its reader gone."""
        rid = entry.request_id
        if rid in self._early and any(self._may_cancel(tenant, entry) for tenant in self._early.pop(rid)):
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
            # Only the services' topic asks for snapshots: a tenant's cannot make every worker publish its cache.
            if b'"kv_snapshot"' in message.value and self._tenant_of.get(message.topic) is None:
                if self._snapshot_asked(message.value):
                    continue
            try:
                cancel = CancelRequest.model_validate_json(message.value)
            except ValidationError:
                log.warning("worker.bad_control_message", extra={"offset": message.offset})
                continue
            tenant = self._tenant_of.get(message.topic)
            entry = self.in_flight.get(cancel.request_id)
            if entry is None:
                self._early.setdefault(cancel.request_id, set()).add(tenant)
                while len(self._early) > EARLY_CANCELS_KEPT:
                    self._early.popitem(last=False)
                continue
            if self._may_cancel(tenant, entry):
                await self.stop(entry, cancel.reason)

    def _snapshot_asked(self, value: bytes) -> bool:
        """Whether ``value`` is a router's request for the workers' (of a model, or all) KV-cache snapshots;
        answered here when it is."""
        try:
            request = KVSnapshotRequest.model_validate_json(value)
        except ValidationError:
            return False  # perhaps a cancel whose text mentions it
        if self.kv_events is not None and request.model in (None, self.kv_events.model):
            self.kv_events.request_snapshot()
        return True

    @staticmethod
    def _may_cancel(tenant: str | None, entry: Active) -> bool:
        """Whether a cancel from ``tenant``'s control topic (None: the services') may stop ``entry``'s request."""
        if tenant is None or entry.tenant == tenant:
            return True
        log.warning("worker.cancel_refused", extra={"request_id": entry.request_id, "cancel_tenant": tenant})
        return False

    async def stop(self, entry: Active, reason: str) -> None:
        """Cancel a request this worker holds: never started if it has not been, aborted in the engine if it runs."""
        log.info("worker.cancel", extra={"request_id": entry.request_id, "reason": reason})
        entry.cancelled = True
        for engine_id in entry.engine_request_ids:
            await self.engine.abort(engine_id)
