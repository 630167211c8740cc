"""The requests a worker holds: one entry per record taken from Kafka, registered under its request id.

An entry is registered under a provisional key (``topic:partition:offset``) when its record is taken, and
under the request id once the record parses; a second record for a request that is still running here is a
duplicate, unless the first was handed off (its partition revoked) and is only unwinding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from gpu_workers.engine import RequestStream
from gpu_workers.engine.lora.request import LoRARequest
from schemas.names import Tier

log = logging.getLogger(__name__)


@dataclass
class Active:
    """One request (or not-yet-parsed record) the worker holds."""

    request_id: str
    partition: TopicPartition
    offset: int
    tier: Tier = "batch"
    handed_off: bool = False  # partition revoked: the new owner continues it, emit nothing more
    # Its owner epoch, raised by its pick-up (:mod:`.fencing`): every write for it carries it. None before.
    epoch: int | None = None
    fenced: bool = False  # a newer owner's epoch refused its writes (``handed_off`` is set too)
    cancelled: bool = False
    # The ingress instance relaying its output to a client that cannot resume it (``InferenceRequest.reader``).
    reader: str | None = None
    # Its tenant, once the record parsed: with tenants apart its stream and record keys carry it.
    tenant: str | None = None
    task: asyncio.Task | None = field(default=None, repr=False)
    # The engine request started before the pickup reads answered (see ``Serving.start_early``).
    early: RequestStream | None = field(default=None, repr=False)
    prompt: list[int] | None = field(default=None, repr=False)  # token ids, once computed
    lora: LoRARequest | None = field(default=None, repr=False)  # its LoRA adapter, once resolved (Adapters)
    watch: Any = field(default=None, repr=False)  # its telemetry.RequestWatch while it is served
    # The engine's ids for it when not its request id: a resumed request with n > 1 runs one per choice.
    engine_ids: tuple[str, ...] = ()
    taken_at: float = field(default_factory=time.monotonic)
    # Wall-clock (unix seconds) of the take and of its first output: the usage record's queue and TTFT times.
    taken_wall: float = field(default_factory=time.time)
    first_output_wall: float | None = None
    # Its first output reached the worker: it no longer waits for a first token (see ``tier_limits``).
    produced: bool = False
    # Its start in the intake's per-tenant fair queue (a ``fair_intake.Held``), settled when it ends with
    # ``used_tokens`` (prompt + output, set once it finishes; None: the estimate stands).
    fair_ticket: Any = field(default=None, repr=False)
    used_tokens: int | None = None

    @property
    def engine_request_ids(self) -> tuple[str, ...]:
        """What to abort in the engine to stop this request."""
        return self.engine_ids or (self.request_id,)

    @property
    def provisional_key(self) -> str:
        """The key the entry is held under until its request id is known."""
        return f"{self.partition.topic}:{self.partition.partition}:{self.offset}"


class InFlight:
    """The worker's held requests by key; claims a request id for one entry at a time."""

    def __init__(self) -> None:
        self._entries: dict[str, Active] = {}

    def __iter__(self) -> Iterator[Active]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Active | None:
        return self._entries.get(key)

    def take(self, partition: TopicPartition, offset: int, tier: Tier) -> Active:
        """Hold a record just taken from Kafka, under its provisional key until its request id is known."""
        key = f"{partition.topic}:{partition.partition}:{offset}"
        entry = Active(request_id=key, partition=partition, offset=offset, tier=tier)
        self._entries[entry.request_id] = entry
        return entry

    def tasks(self) -> list[asyncio.Task]:
        return [entry.task for entry in self._entries.values() if entry.task is not None]

    def claim_at_once(self, entry: Active, request_id: str) -> bool:
        """Register ``entry`` under its request id when no other entry holds it (else :meth:`claim` decides)."""
        if request_id in self._entries:
            return False
        entry.request_id = request_id
        self._entries[request_id] = self._entries.pop(entry.provisional_key)
        return True

    async def claim(self, entry: Active, request_id: str) -> bool:
        """Register ``entry`` under its request id; False for a duplicate of a request still running here.

        After a rebalance gives a partition back to this worker, its handed-off task for the same
        request may still be unwinding (its engine abort in flight): wait for it, then take over.
        """
        while (other := self._entries.get(request_id)) is not None and other is not entry:
            if not other.handed_off:
                log.warning("worker.duplicate_request", extra={"request_id": request_id, "offset": entry.offset})
                return False
            if other.task is None or other.task.done():
                del self._entries[request_id]
            else:
                await asyncio.wait({other.task})
        return self.claim_at_once(entry, request_id)

    def release(self, entry: Active) -> None:
        """Forget ``entry`` under whichever key it is held."""
        for key in (entry.request_id, entry.provisional_key):
            if self._entries.get(key) is entry:
                del self._entries[key]
