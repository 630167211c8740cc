"""What a request's stream already holds, and the pick-up: the round trip that takes a request over and reads
its stream, status record and cancel marker before a worker starts it.

A re-delivered request continues from the tokens its stream holds (``restart`` honoured); the pick-up also raises
the request's owner epoch (:mod:`.fencing`), so the previous owner can no longer write once the new one has read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.client import Pipeline

from schemas import (
    STREAM_FIELD,
    DoneEvent,
    ErrorEvent,
    Names,
    RequestRecord,
    RestartEvent,
    TokenEvent,
    parse_stream_event,
)
from schemas.events import FinishReason

from .fencing import queue_claim
from .streams import StreamPublisher

log = logging.getLogger(__name__)

# How long a pick-up's WAIT gives a replica to acknowledge the raised epoch. On localhost a replica answers in
# well under a millisecond; a replica that is listed but does not answer (stopped, cut off) holds every pick-up
# this long per try until the primary drops it (its repl-timeout), as min-replicas-to-write would.
_CLAIM_WAIT_MS = 100


@dataclass
class DeliveredChoice:
    """What one choice (``n`` > 1) already delivered, and its end if its last event carried one."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


@dataclass
class StreamState:
    """What a request's stream already holds, for continuing it after a re-delivery."""

    exists: bool = False
    next_seq: int = 0
    token_ids: list[int] = field(default_factory=list)  # every choice's, in stream order
    text: str = ""
    done: DoneEvent | None = None
    error: ErrorEvent | None = None
    choices: dict[int, DeliveredChoice] = field(default_factory=dict)  # by index

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    @property
    def delivered(self) -> int:
        return len(self.token_ids)


async def read_stream_state(
    redis: aioredis.Redis, names: Names, request_id: str, tenant: str | None = None
) -> StreamState:
    """Replay the stream's events (honouring ``restart``) into the tokens a client has received."""
    return stream_state_from_entries(await redis.xrange(names.stream_key(request_id, tenant)))


@dataclass
class PickupState:
    """Everything a worker reads before it starts a request, fetched in one round trip."""

    stream: StreamState
    record: bytes | None  # the RequestRecord JSON, if any
    cancel_marked: bool
    # Whether the lease key asked for exists (None: none was asked for; see ``readers``).
    lease_exists: bool | None = None
    epoch: int = 0  # the owner epoch this pick-up raised the request to: its writes carry it

    @property
    def ended_before(self) -> bool:
        """Whether the status record says the request ended (its stream may since have expired)."""
        if self.record is None:
            return False
        try:
            status = RequestRecord.model_validate_json(self.record).status
        except ValidationError:
            return False
        return status in ("finished", "cancelled", "failed")


async def read_pickup_state(
    publisher: StreamPublisher, names: Names, request_id: str, lease_key: str | None = None, tenant: str | None = None
) -> PickupState:
    """Take the request over (raise its owner epoch) and read its stream, its status record and its cancel marker
    (and ``lease_key``'s existence, when given), in one round trip that also carries everything the publisher holds
    (other requests' appends and status records: a round trip fewer for them).

    The raise goes first, so a previous owner's write lands before the read or is refused (:mod:`.fencing`).
    With ``replica_ack`` the round trip ends with ``WAIT`` for a replica to hold the raise: a failover to a replica
    without it would let the previous owner write again. Not acknowledged while the primary lists a replica, the
    pick-up is made again; with no replica listed it goes ahead (a replica that connects later syncs from this
    primary, raise included).

    Three sequential reads cost about 10 ms p50 of pickup latency on a loaded box (benchmarks/pipeline.py).
    """
    while True:
        wait = publisher.replica_ack and publisher.replicas > 0

        def reads(pipe: Pipeline, wait: bool = wait) -> None:
            queue_claim(pipe, names, request_id, tenant, publisher.ttl_s)
            pipe.xrange(names.stream_key(request_id, tenant))
            pipe.get(names.request_key(request_id, tenant))
            pipe.exists(names.cancel_key(request_id, tenant))
            if lease_key is not None:
                pipe.exists(lease_key)
            if wait:
                pipe.execute_command("WAIT", 1, _CLAIM_WAIT_MS)

        replies = await publisher.flush_reading(reads)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        epoch, _, entries, record, cancel, *rest = replies
        acknowledged = bool(rest.pop()) if wait else False
        if not publisher.replica_ack or acknowledged or publisher.replicas == 0:
            break
        log.warning("worker.claim_unreplicated", extra={"request_id": request_id, "epoch": int(epoch)})
    lease = bool(rest[0]) if rest else None
    return PickupState(stream_state_from_entries(entries), record, bool(cancel), lease, int(epoch))


def stream_state_from_entries(entries: list[Any]) -> StreamState:
    """Fold XRANGE entries into what the client has received."""
    state = StreamState(exists=bool(entries))
    tokens: list[TokenEvent] = []
    for _entry_id, fields in entries:
        event = parse_stream_event(fields[STREAM_FIELD.encode()])
        state.next_seq = event.seq + 1
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, RestartEvent):
            tokens = [t for t in tokens if t.seq <= event.discard_after_seq]
        elif isinstance(event, DoneEvent):
            state.done = event
        elif isinstance(event, ErrorEvent):
            state.error = event
    state.token_ids = [tid for t in tokens for tid in t.token_ids]
    state.text = "".join(t.text for t in tokens)
    for token in tokens:
        choice = state.choices.setdefault(token.index, DeliveredChoice())
        choice.token_ids += token.token_ids
        choice.text += token.text
        choice.finish_reason = token.finish_reason or choice.finish_reason
    return state
