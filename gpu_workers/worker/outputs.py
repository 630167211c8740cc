"""Everything a worker writes: stream events and status records to Redis, final results, usage records and dead
letters to Kafka, each retried until it is taken.

A request's offset waits for these writes, so retrying (never dropping) is what makes a crash or an outage
cost a delay, not a lost or doubled outcome: stream appends carry explicit ids (:mod:`.streams`), results
are keyed by request id and ``llm.results`` is at-least-once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import (
    ChoiceResult,
    DoneEvent,
    FinalResult,
    InferenceRequest,
    Names,
    RequestRecord,
    StreamEvent,
    Usage,
    parse_batch_request_id,
    utcnow,
)
from schemas.events import FinishReason
from sluicegate.record_check import Rejection, dead_letter
from sluicegate.usage.ledger import usage_record

from .config import WorkerConfig
from .in_flight import Active
from .observer import WorkerObserver
from .streams import REDIS_UNAVAILABLE, RecordWrite, StreamPublisher
from .telemetry import WorkerTelemetry

log = logging.getLogger(__name__)

T = TypeVar("T")

# Replicas acknowledge their offset about once a second; asking more often than this would find nothing new.
_CONFIRM_INTERVAL_S = 0.5
# How long a final status record waits for another request's flush to carry it before flushing alone. It delays
# only the offset commit (itself gathered over ``commit_interval_s``, 50 ms) and the end of the request's task (the
# client has ``done`` already); under load the flush loop runs every engine step (~16 ms on the loaded 2-core box at
# 50 req/s), so most records ride within it.
_RECORD_RIDE_S = 0.02


class Outputs:
    """The worker's writers: the Redis stream publisher and its flush loop, status records, ``llm.results``
    and ``llm.dlq``."""

    def __init__(
        self,
        config: WorkerConfig,
        names: Names,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        observer: WorkerObserver | None = None,
        stream_redis: aioredis.Redis | None = None,
        on_fenced: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.names = names
        self.redis = redis
        self.producer = producer
        on_send = observer.events_sending if observer is not None else None
        # ``stream_redis``: a client that does not retry pipelines itself (needed by ``replica_ack``).
        self.publisher = StreamPublisher(
            stream_redis or redis,
            names,
            config.stream_ttl_s,
            on_send=on_send,
            replica_ack=config.replica_ack,
            max_unconfirmed=config.replica_ack_max_events,
            worker_id=config.worker_id,
            on_fenced=on_fenced,
        )
        self._events = asyncio.Event()
        self.dead_lettered = 0
        self.telemetry: WorkerTelemetry | None = None  # set by the Worker

    # --- Redis streams -------------------------------------------------------------------------------
    def emit(self, entry: Active, event: StreamEvent | RecordWrite, *, wake: bool = True) -> bool:
        """Queue one event (or status-record write) for the next flush, unless the request was handed to
        another owner.

        Every append goes through here with no await between the check and the add, so once
        :meth:`Intake.hand_off <.intake.Intake.hand_off>` has flushed, nothing more is written for a request
        that moved away. ``wake=False`` leaves the flush loop asleep: the write rides with whatever is flushed
        next (the request's own first token or end at the latest) instead of a round trip of its own.
        """
        if entry.handed_off:
            return False
        self.publisher.add(event, entry.tenant, entry.epoch or 0)
        if wake:
            self._events.set()
        return True

    async def flush(self) -> None:
        """Returns once Redis holds everything emitted so far."""
        # What woke the flush loop goes in this flush: a wake left set would send the next ``wake=False`` write
        # (a running record) alone.
        self._events.clear()
        await self.publisher.flush()

    async def flush_loop(self) -> None:
        while True:
            if self.publisher.unconfirmed:
                # Events await a replica's acknowledgement: flush (only ROLE when nothing is new) at least this
                # often, so they are confirmed, or re-appended after a failover, while no request writes.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._events.wait(), _CONFIRM_INTERVAL_S)
            else:
                await self._events.wait()
            self._events.clear()
            # Let every request whose delta came out of the same engine step add its event first.
            await asyncio.sleep(0)
            await self.publisher.flush()

    async def redis_call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis operation, retrying with backoff while Redis is unreachable (a restart, a failover).

        The request waits rather than failing: its offset stays uncommitted, so nothing is lost either way.
        """
        delay = 0.05
        while True:
            try:
                return await call()
            except REDIS_UNAVAILABLE as exc:
                log.warning("worker.redis_unavailable", extra={"error": str(exc), "retry_in_s": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.redis_retry_max_s)

    # --- status records ------------------------------------------------------------------------------
    def record_write(self, request: InferenceRequest, status: str, result: FinalResult | None = None) -> RecordWrite:
        record = RequestRecord(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            priority=request.priority,
            status=status,  # type: ignore[arg-type]
            created_at=request.created_at,
            worker_id=self.config.worker_id,
            result=result,
            trace=request.trace,
        )
        key = self.names.request_key(request.request_id, request.tenant)
        return RecordWrite(key, record.model_dump_json(), self.config.stream_ttl_s, request.request_id)

    async def set_record(
        self, request: InferenceRequest, status: str, epoch: int, result: FinalResult | None = None
    ) -> None:
        """Write the status record in the stream publisher's next pipeline and return once Redis has it.

        A round trip of its own per request was a third of the worker's Redis round trips; carried by
        the publisher, it shares the pipeline of other requests' appends, waiting at most ``_RECORD_RIDE_S`` for
        one. Not through :meth:`emit`: a request handed off meanwhile still gets its record (its stream already
        holds ``done``), as with a plain ``SET``; fenced like every write, as the owner of ``epoch``: once a newer owner
        took the request over, the record is its to write.
        """
        write = self.record_write(request, status, result)
        await self.publisher.ride(write, _RECORD_RIDE_S, request.tenant, epoch)

    async def mark_failed(
        self, request_id: str, tenant: str | None, epoch: int, result: FinalResult | None = None
    ) -> None:
        """Set an existing status record to ``failed`` (a request with none keeps none), with the failed ``result``
        when known: its ``error_code`` and ``error_message`` tell a client that missed the stream why. Written as
        the owner of ``epoch``, in the publisher's next flush."""
        key = self.names.request_key(request_id, tenant)
        raw = await self.redis_call(lambda: self.redis.get(key))
        if raw is not None:
            record = RequestRecord.model_validate_json(raw)
            changes: dict[str, object] = {"status": "failed", "updated_at": utcnow()}
            if result is not None:
                changes |= {"result": result, "worker_id": result.worker_id}
            update = record.model_copy(update=changes)
            write = RecordWrite(key, update.model_dump_json(), self.config.stream_ttl_s, request_id)
            await self.publisher.ride(write, _RECORD_RIDE_S, tenant, epoch)

    # --- Kafka ---------------------------------------------------------------------------------------
    async def publish_result(
        self,
        request: InferenceRequest,
        done: DoneEvent,
        tokens: list[int],
        text: str,
        choices: list[ChoiceResult] | None = None,
        entry: Active | None = None,
        *,
        epoch: int,
    ) -> None:
        """The final result to ``llm.results`` and the usage record to ``llm.usage``, then the status record; a
        record that says the request ended therefore means both went out. ``entry``: the request as this worker
        held it, for the usage record's timings (none when a previous owner's ``done`` is published again);
        ``epoch``: the owner epoch the record is written as."""
        result = FinalResult(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            text=text,
            token_ids=tokens,
            finish_reason=done.finish_reason,
            usage=done.usage,
            choices=choices,
            embedding=done.embedding,
            worker_id=self.config.worker_id,
            created_at=request.created_at,
        )
        await self._send_ending(result, self._usage_value(request, entry, done.usage, done.finish_reason))
        status = "cancelled" if done.finish_reason == "abort" else "finished"
        await self.set_record(request, status, epoch, result)

    async def publish_failure(
        self, request: InferenceRequest, entry: Active | None, code: str, message: str
    ) -> FinalResult:
        """A failed request's result to ``llm.results`` (no text, ``finish_reason`` "error", ``error_code`` and
        ``error_message`` set) with its usage record as failed, both in one produce request: a Kafka-native
        consumer of ``llm.results`` (and a batch's collector) learns of the failure there, as of any ending,
        instead of waiting for a result that never comes. Returns that result."""
        result = FinalResult(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            text="",
            token_ids=[],
            finish_reason="error",
            usage=Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0),
            error_code=code,
            error_message=message,
            worker_id=self.config.worker_id,
            created_at=request.created_at,
        )
        await self._send_ending(result, self._usage_value(request, entry, None, None, code))
        return result

    async def _send_ending(self, result: FinalResult, usage: bytes) -> None:
        """A request's result and usage records in one produce request (one acknowledgement to wait for, not two
        in a row)."""
        rid = result.request_id
        # A batch line's result is the batch service's to collect (its tenant reads it through the Batches API), so
        # it stays on the shared topic the one collector reads; any other goes to its tenant's with tenants apart.
        topic = self.names.results_topic if parse_batch_request_id(rid) else self.names.results_topic_of(result.tenant)
        await self.send_all(
            [
                (topic, result.model_dump_json().encode(), rid),
                (self.names.usage_topic, usage, rid),
            ]
        )

    def _usage_value(
        self,
        request: InferenceRequest,
        entry: Active | None,
        usage: Usage | None,
        finish_reason: FinishReason | None,
        error_code: str | None = None,
    ) -> bytes:
        record = usage_record(
            request,
            producer=self.config.worker_id,
            usage=usage,
            finish_reason=finish_reason,
            error_code=error_code,
            started_at=entry.taken_wall if entry is not None else None,
            first_output_at=entry.first_output_wall if entry is not None else None,
        )
        return record.model_dump_json().encode()

    async def dead_letter(self, record: Any, rejection: Rejection) -> None:
        """Put the record on ``llm.dlq`` (its tenant's, with tenants apart) with its reason; retried until Kafka takes
        it (the offset waits)."""
        value, headers = dead_letter(rejection, record)
        await self.send(self.names.dlq_topic_of(rejection.tenant), value, rejection.request_id, headers)
        self.dead_lettered += 1
        if self.telemetry is not None:
            self.telemetry.dead_lettered(rejection.reason)
        log.warning(
            "worker.dead_letter",
            extra={
                "reason": rejection.reason,
                "request_id": rejection.request_id,
                "detail": rejection.detail[:200],
                "topic": record.topic,
                "offset": record.offset,
            },
        )

    async def send_all(self, records: list[tuple[str, bytes, str]]) -> None:
        """Produce several ``(topic, value, key)`` records at once, retrying each until Kafka acknowledges it.

        All are queued before any acknowledgement is awaited, so the producer sends them in one request. A record
        that failed is sent again alone (those acknowledged are not: no duplicate beyond what :meth:`send` makes).
        """
        pending = records
        delay = 0.2
        while True:
            sent: list[tuple[tuple[str, bytes, str], asyncio.Future[Any]]] = []
            failed: list[tuple[str, bytes, str]] = []
            error: KafkaError | None = None
            for record in pending:
                topic, value, key = record
                try:
                    sent.append((record, await self.producer.send(topic, value, key=key.encode())))
                except KafkaError as exc:
                    failed.append(record)
                    error = exc
            for record, future in sent:
                try:
                    await future
                except KafkaError as exc:
                    failed.append(record)
                    error = exc
            if not failed:
                return
            topics = sorted({topic for topic, _, _ in failed})
            log.warning("worker.publish_failed", extra={"topic": topics, "error": repr(error), "retry_in_s": delay})
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            pending = failed

    async def send(
        self, topic: str, value: bytes, key: str | None, headers: list[tuple[str, bytes]] | None = None
    ) -> None:
        """Produce one record, retrying until Kafka acknowledges it: the request's offset waits meanwhile,
        so a final result or a dead letter is never dropped (at worst sent twice after a crash)."""
        delay = 0.2
        while True:
            try:
                await self.producer.send_and_wait(topic, value, key=key.encode() if key else None, headers=headers)
                return
            except KafkaError as exc:
                log.warning("worker.publish_failed", extra={"topic": topic, "error": repr(exc), "retry_in_s": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
