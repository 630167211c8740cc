"""The usage records ingress itself writes: a response-cache hit ends in ingress (no worker sees it), so ingress
sends its ``llm.usage`` record (:mod:`sluicegate.usage.ledger`).

Sent in the background once the hit's reply is in its Redis stream, so the answer does not wait for a Kafka
acknowledgement; retried while Kafka is away, and waited for (bounded) when ingress stops. An ingress that dies
in between loses that one record: nothing re-delivers a hit, which never reached Kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import DoneEvent, InferenceRequest, Names, StreamEvent, UsageRecord
from sluicegate.usage.ledger import RESPONSE_CACHE, usage_record

log = logging.getLogger(__name__)

Lease = Callable[[], AbstractAsyncContextManager[AIOKafkaProducer]]

#: How long a record is retried before it is given up (logged).
_GIVE_UP_S = 300.0


def cache_hit_record(request: InferenceRequest, events: list[StreamEvent]) -> UsageRecord | None:
    """The record of a request answered from the response cache (its replayed ``done`` says the usage)."""
    done = events[-1] if events else None
    if not isinstance(done, DoneEvent):
        return None
    now = time.time()
    return usage_record(
        request,
        producer=RESPONSE_CACHE,
        usage=done.usage,
        finish_reason=done.finish_reason,
        started_at=now,
        first_output_at=now,
    )


class UsageLedger:
    """Background sends of ingress's usage records through a leased ingress producer."""

    def __init__(self, names: Names, lease: Lease, *, timeout_s: float) -> None:
        self._names = names
        self._lease = lease
        self._timeout_s = timeout_s
        self._sends: set[asyncio.Task[None]] = set()

    def send_later(self, record: UsageRecord) -> None:
        task = asyncio.create_task(self._send(record))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, record: UsageRecord) -> None:
        value = record.model_dump_json().encode()
        delay, deadline = 0.2, time.monotonic() + _GIVE_UP_S
        while True:
            try:
                async with asyncio.timeout(self._timeout_s), self._lease() as producer:
                    await producer.send_and_wait(self._names.usage_topic, value, key=record.request_id.encode())
                return
            except (KafkaError, TimeoutError, OSError) as exc:
                if time.monotonic() > deadline:
                    log.error("ingress.usage_record_lost request_id=%s error=%r", record.request_id, exc)
                    return
                log.warning("ingress.usage_record_retry request_id=%s error=%r", record.request_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def close(self) -> None:
        """Wait (up to the Kafka timeout) for the records still being sent, then stop trying."""
        pending = list(self._sends)
        if pending:
            _, late = await asyncio.wait(pending, timeout=self._timeout_s)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
