"""The worker's KV-cache events: each engine step's cached and evicted blocks (the engine journals them and its
front hands them over with the step's deltas) published on ``llm.kv_events`` as one ``KVCacheEvents`` per tier that
changed (the pool, and the offload tiers blocks were written down to or dropped from), numbered per worker; a
snapshot of the whole cache (its local tiers too) at start and whenever a ``KVSnapshotRequest`` asks (a router that
joined late, or that lost a message and saw the gap in the numbers). What a router does with them:
:mod:`router.kv_index`.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from gpu_workers.engine import EngineFront
from gpu_workers.engine.outputs import KVCacheEvents as EngineKVEvents
from schemas import KVBlockStored, KVCacheEvents, Names

log = logging.getLogger(__name__)

#: A snapshot asked for while one is queued adds nothing: one marker stands for both.
_SNAPSHOT = None


def to_message(events: EngineKVEvents, *, model: str, worker_id: str, seq: int) -> KVCacheEvents:
    """The contract's form of one tier's events (hashes hex; a snapshot lists hashes without parents; the nested
    tiers' events are messages of their own)."""
    stored = [
        KVBlockStored(hash=h.hex(), parent=None if events.snapshot else parent.hex()) for h, parent in events.stored
    ]
    return KVCacheEvents(
        model=model,
        worker_id=worker_id,
        seq=seq,
        tier=events.tier,
        block_size=events.block_size,
        snapshot=events.snapshot,
        stored=stored,
        removed=[h.hex() for h in events.removed],
    )


class KVEventPublisher:
    """Numbers and publishes the engine's KV events in the order the engine made them.

    Step events reach the event loop as a callback; they queue with snapshot requests and one task sends them
    in order, so a snapshot sits between the events before and after it (a step's events observed while the
    snapshot call is on its way are sent after it: replayed on top of it they change nothing, being older).
    """

    def __init__(self, engine: EngineFront, producer: AIOKafkaProducer, names: Names, model: str, worker_id: str):
        self.engine = engine
        self.producer = producer
        self.topic = names.kv_events_topic
        self.model = model
        self.worker_id = worker_id
        self._next_seq = 0
        self._queue: asyncio.Queue[EngineKVEvents | None] = asyncio.Queue()
        self._snapshot_queued = False
        self.published = 0
        engine.add_kv_event_observer(self._queue.put_nowait)

    @property
    def last_seq(self) -> int | None:
        """The seq of the latest message handed to Kafka (for the heartbeat); None before the first."""
        return self._next_seq - 1 if self._next_seq else None

    def request_snapshot(self) -> None:
        """Publish the whole cache next (a router asked, or the worker starts)."""
        if not self._snapshot_queued:
            self._snapshot_queued = True
            self._queue.put_nowait(_SNAPSHOT)

    async def run(self) -> None:
        self.request_snapshot()
        while True:
            item = await self._queue.get()
            if item is _SNAPSHOT:
                self._snapshot_queued = False
                item = await self.engine.kv_snapshot()
            await self._send(item)

    async def _send(self, events: EngineKVEvents) -> None:
        """The pool's message (unless a step changed only the tiers), then one per offload tier that changed."""
        if events.snapshot or events.stored or events.removed:
            await self._send_one(events)
        for below in events.tiers:
            await self._send_one(below)

    async def _send_one(self, events: EngineKVEvents) -> None:
        message = to_message(events, model=self.model, worker_id=self.worker_id, seq=self._next_seq)
        self._next_seq += 1
        try:
            # Not awaited to the acknowledgement: a slow Kafka must not hold the next step's events back.
            sent = await self.producer.send(self.topic, message.model_dump_json().encode(), key=self.worker_id.encode())
            sent.add_done_callback(_log_send_failure)
            self.published += 1
        except KafkaError as exc:
            # Lost: readers see the gap in seq (or the heartbeat's seq ahead of theirs) and ask for a snapshot.
            log.warning("worker.kv_events_failed", extra={"error": repr(exc), "seq": message.seq})


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("worker.kv_events_failed", extra={"error": repr(future.exception())})
