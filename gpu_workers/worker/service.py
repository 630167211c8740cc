"""The GPU worker: consumes a model's request topics, runs the engine, streams events to Redis.

Guarantees it keeps (see DESIGN.md, request flow 3-5):
* tiers drain in order (interactive, standard, batch) and partitions are paused while the engine
  has no room, so the backlog stays in Kafka, not in worker memory;
* an offset is committed only when every request at or below it has finished;
* a re-delivered request continues from the tokens its stream already holds;
* every event of one flush goes to Redis in one pipelined round trip, with entry ids from ``seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from pydantic import ValidationError

from schemas import (
    TIERS,
    CancelRequest,
    DeadLetter,
    DoneEvent,
    ErrorEvent,
    FinalResult,
    InferenceRequest,
    Names,
    PartitionRef,
    RequestRecord,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
    utcnow,
)
from schemas.events import FinishReason
from schemas.names import HEADER_REASON, HEADER_REQUEST_ID, Tier

from .offsets import CompletionWatermarks
from .prompts import PromptError, prompt_token_ids, sampling_params
from .streams import StreamPublisher, read_stream_state

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """What the worker needs of ``gpu_workers.engine.AsyncEngine``."""

    tokenizer: Any

    def generate(self, prompt: list[int], params: Any, *, request_id: str, priority: str) -> Any: ...
    async def abort(self, request_id: str) -> None: ...
    def stats(self) -> Any: ...


@dataclass
class WorkerConfig:
    """Knobs of one worker process."""

    model_name: str
    worker_id: str
    max_in_flight: int = 64
    heartbeat_interval_s: float = 2.0
    stream_ttl_s: int = 3600
    drain_timeout_s: float = 30.0
    session_timeout_ms: int = 6000
    heartbeat_ms: int = 1500
    device: str = "cpu"


@dataclass
class _Active:
    request_id: str
    partition: TopicPartition
    offset: int
    handed_off: bool = False  # partition revoked: the new owner continues it, emit nothing more
    cancelled: bool = False
    task: asyncio.Task | None = field(default=None, repr=False)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._worker.hand_off(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info(
            "worker.partitions_assigned",
            extra={"partitions": sorted(f"{p.topic}:{p.partition}" for p in assigned)},
        )


class Worker:
    """One engine, one consumer-group member, one Redis publisher."""

    def __init__(
        self,
        engine: EngineLike,
        config: WorkerConfig,
        *,
        names: Names,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        control_consumer: AIOKafkaConsumer,
    ) -> None:
        self.engine = engine
        self.config = config
        self.names = names
        self.redis = redis
        self.producer = producer
        self.consumer = consumer
        self.control = control_consumer
        self.publisher = StreamPublisher(redis, names, config.stream_ttl_s)
        self.watermarks: CompletionWatermarks[TopicPartition] = CompletionWatermarks()
        self.active: dict[str, _Active] = {}
        self._tiers: dict[str, Tier] = {names.request_topic(config.model_name, t): t for t in TIERS}
        self._room = asyncio.Event()
        self._events = asyncio.Event()
        self._stopping = asyncio.Event()
        # Cancels that arrived before their request was picked up (bounded, oldest dropped).
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self.served = 0

    @property
    def topics(self) -> list[str]:
        return list(self._tiers)

    def rebalance_listener(self) -> ConsumerRebalanceListener:
        return _Rebalance(self)

    # --- main loop ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then drain in-flight requests and commit."""
        loops = [
            asyncio.create_task(self._fetch_loop(), name="fetch"),
            asyncio.create_task(self._flush_loop(), name="flush"),
            asyncio.create_task(self._control_loop(), name="control"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*loops, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            self._stopping.set()
            stopper.cancel()
            await self._drain()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._remove_heartbeat()

    async def _drain(self) -> None:
        """Stop taking work, let what runs finish (bounded), then flush and commit."""
        with contextlib.suppress(Exception):
            self.consumer.pause(*self.consumer.assignment())
        tasks = [a.task for a in self.active.values() if a.task is not None]
        if tasks:
            log.info("worker.draining", extra={"in_flight": len(tasks)})
            _, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.publisher.flush()
        await self._commit()

    async def _fetch_loop(self) -> None:
        while not self._stopping.is_set():
            assigned = self.consumer.assignment()
            room = self.config.max_in_flight - len(self.active)
            if not assigned or room <= 0:
                if assigned:
                    self.consumer.pause(*assigned)
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 0.2)
                continue
            self.consumer.resume(*assigned)
            for record in await self._fetch_by_tier(assigned, room):
                self._admit(record)

    async def _fetch_by_tier(self, assigned: set[TopicPartition], room: int) -> list[Any]:
        """Records already fetched for the highest non-empty tier; else wait briefly for any."""
        by_tier: dict[Tier, list[TopicPartition]] = {t: [] for t in TIERS}
        for tp in assigned:
            tier = self._tiers.get(tp.topic)
            if tier is not None:
                by_tier[tier].append(tp)
        for tier in TIERS:
            if by_tier[tier]:
                batch = await self.consumer.getmany(*by_tier[tier], timeout_ms=0, max_records=room)
                if batch:
                    return [r for records in batch.values() for r in records]
        batch = await self.consumer.getmany(timeout_ms=100, max_records=room)
        records = [r for records in batch.values() for r in records]
        records.sort(key=lambda r: TIERS.index(self._tiers.get(r.topic, "batch")))
        return records

    def _admit(self, record: Any) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self.watermarks.started(tp, record.offset)
        key = f"{tp.topic}:{tp.partition}:{record.offset}"
        task = asyncio.create_task(self._serve(tp, record), name=key)
        # Registered under a provisional key until the request id is parsed.
        self.active[key] = _Active(request_id=key, partition=tp, offset=record.offset, task=task)

    # --- one request ---------------------------------------------------------------------------------
    async def _serve(self, tp: TopicPartition, record: Any) -> None:
        provisional = f"{tp.topic}:{tp.partition}:{record.offset}"
        entry = self.active[provisional]
        try:
            try:
                request = InferenceRequest.model_validate_json(record.value)
            except ValidationError as exc:
                await self._dead_letter(record, "invalid_request", _first_error(exc))
                return
            entry.request_id = request.request_id
            self.active[request.request_id] = self.active.pop(provisional)
            await self._serve_request(request, entry, record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("worker.request_failed", extra={"offset": record.offset})
            if entry.request_id != provisional and not entry.handed_off:
                await self._fail(entry.request_id, "internal_error", str(exc))
        finally:
            self.active.pop(entry.request_id, None)
            self.active.pop(provisional, None)
            if not entry.handed_off:
                self.watermarks.finished(tp, record.offset)
                await self._commit()
            self._room.set()

    async def _serve_request(self, request: InferenceRequest, entry: _Active, record: Any) -> None:
        rid = request.request_id
        state = await read_stream_state(self.redis, self.names, rid)
        if state.finished:
            return  # re-delivered after it finished but before its offset was committed
        seq = state.next_seq
        if rid in self._early_cancels or await self.redis.exists(self.names.cancel_key(rid)):
            await self._finish(request, seq, "abort", state.token_ids, state.text, 0, 0)
            return
        if request.expired():
            await self._fail(rid, "deadline_exceeded", "the request's deadline passed before it started", seq)
            await self._dead_letter(record, "deadline_exceeded", f"deadline {request.deadline.isoformat()}")
            return
        try:
            prompt = prompt_token_ids(request, self.engine.tokenizer)
        except PromptError as exc:
            await self._fail(rid, "invalid_prompt", str(exc), seq)
            return
        if state.delivered >= request.sampling.max_tokens:
            await self._finish(request, seq, "length", state.token_ids, state.text, len(prompt), 0)
            return
        await self._set_record(request, "running")
        tokens, text = list(state.token_ids), state.text
        finish: FinishReason = "stop"
        cached = 0
        params = sampling_params(request, state.delivered)
        async for delta in self.engine.generate(
            prompt + state.token_ids, params, request_id=rid, priority=request.priority
        ):
            if entry.handed_off:
                return
            if delta.token_ids or delta.text:
                self.publisher.add(TokenEvent(request_id=rid, seq=seq, text=delta.text, token_ids=delta.token_ids))
                seq += 1
                tokens.extend(delta.token_ids)
                text += delta.text
                self._events.set()
            cached = getattr(delta, "num_cached_tokens", cached) or cached
            if delta.finish_reason is not None:
                finish = delta.finish_reason
        if entry.handed_off:
            return
        await self._finish(request, seq, finish, tokens, text, len(prompt), cached)

    async def _finish(
        self,
        request: InferenceRequest,
        seq: int,
        reason: FinishReason,
        tokens: list[int],
        text: str,
        prompt_tokens: int,
        cached: int,
    ) -> None:
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(tokens),
            total_tokens=prompt_tokens + len(tokens),
            cached_tokens=cached,
        )
        self.publisher.add(DoneEvent(request_id=request.request_id, seq=seq, finish_reason=reason, usage=usage))
        # The stream must hold ``done`` before the offset can be committed.
        await self.publisher.flush()
        result = FinalResult(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            text=text,
            token_ids=tokens,
            finish_reason=reason,
            usage=usage,
            worker_id=self.config.worker_id,
            created_at=request.created_at,
        )
        await self._send(self.names.results_topic, result.model_dump_json().encode(), request.request_id)
        status = "cancelled" if reason == "abort" else "finished"
        await self._set_record(request, status, result)
        self.served += 1

    async def _fail(self, request_id: str, code: str, message: str, seq: int | None = None) -> None:
        if seq is None:
            seq = (await read_stream_state(self.redis, self.names, request_id)).next_seq
        self.publisher.add(ErrorEvent(request_id=request_id, seq=seq, code=code, message=message))
        await self.publisher.flush()
        raw = await self.redis.get(self.names.request_key(request_id))
        if raw is not None:
            record = RequestRecord.model_validate_json(raw)
            update = record.model_copy(update={"status": "failed", "updated_at": utcnow()})
            await self.redis.set(self.names.request_key(request_id), update.model_dump_json(), keepttl=True)

    async def _set_record(self, request: InferenceRequest, status: str, result: FinalResult | None = None) -> None:
        record = RequestRecord(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            priority=request.priority,
            status=status,  # type: ignore[arg-type]
            created_at=request.created_at,
            worker_id=self.config.worker_id,
            result=result,
        )
        await self.redis.set(
            self.names.request_key(request.request_id), record.model_dump_json(), ex=self.config.stream_ttl_s
        )

    async def _dead_letter(self, record: Any, reason: str, detail: str) -> None:
        raw = record.value or b""
        letter = DeadLetter(
            reason=reason,
            detail=detail,
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            payload=raw.decode("utf-8", errors="replace"),
            request_id=_header(record, HEADER_REQUEST_ID),
        )
        await self.producer.send_and_wait(
            self.names.dlq_topic,
            letter.model_dump_json().encode(),
            headers=[(HEADER_REASON, reason.encode())],
        )
        log.warning("worker.dead_letter", extra={"reason": reason, "detail": detail[:200], "offset": record.offset})

    async def _send(self, topic: str, value: bytes, key: str) -> None:
        try:
            await self.producer.send_and_wait(topic, value, key=key.encode())
        except KafkaError:
            log.exception("worker.result_publish_failed", extra={"topic": topic})

    # --- background loops --------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while True:
            await self._events.wait()
            self._events.clear()
            # Let every request whose delta came out of the same engine step add its event first.
            await asyncio.sleep(0)
            await self.publisher.flush()

    async def _commit(self) -> None:
        assigned = self.consumer.assignment()
        offsets = {tp: off for tp, off in self.watermarks.to_commit().items() if tp in assigned}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.watermarks.mark_committed(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance is under way; the new owner re-reads from the last commit, and the
            # stream's explicit ids make the replayed appends harmless.
            log.warning("worker.commit_failed", extra={"error": repr(exc)})

    async def hand_off(self, revoked: set[TopicPartition]) -> None:
        """Partitions are being taken away: stop their requests, persist, commit, forget them."""
        moving = [a for a in self.active.values() if a.partition in revoked]
        for entry in moving:
            entry.handed_off = True
            with contextlib.suppress(Exception):
                await self.engine.abort(entry.request_id)
        await self.publisher.flush()
        await self._commit()
        for tp in revoked:
            self.watermarks.forget(tp)
        if moving:
            log.info("worker.handed_off", extra={"requests": len(moving)})

    async def _control_loop(self) -> None:
        async for message in self.control:
            try:
                cancel = CancelRequest.model_validate_json(message.value)
            except ValidationError:
                log.warning("worker.bad_control_message", extra={"offset": message.offset})
                continue
            entry = self.active.get(cancel.request_id)
            if entry is None:
                self._early_cancels[cancel.request_id] = None
                while len(self._early_cancels) > 10_000:
                    self._early_cancels.popitem(last=False)
                continue
            entry.cancelled = True
            await self.engine.abort(cancel.request_id)

    def heartbeat(self) -> WorkerHeartbeat:
        stats = self.engine.stats()
        return WorkerHeartbeat(
            worker_id=self.config.worker_id,
            model=self.config.model_name,
            partitions=[PartitionRef(topic=tp.topic, partition=tp.partition) for tp in self.consumer.assignment()],
            running=stats.num_running,
            waiting=stats.num_waiting,
            free_kv_blocks=stats.num_free_blocks,
            total_kv_blocks=stats.num_total_blocks,
            prefix_cache_hit_rate=min(1.0, max(0.0, stats.prefix_cache_hit_rate)),
            device=self.config.device,
            draining=self._stopping.is_set(),
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            started = time.monotonic()
            beat = self.heartbeat()
            payload = beat.model_dump_json()
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(self.names.workers_key(self.config.model_name), self.config.worker_id, payload)
                pipe.sadd(self.names.models_key, self.config.model_name)
                await pipe.execute()
            except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                log.warning("worker.heartbeat_redis_failed", extra={"error": str(exc)})
            await self._send(self.names.heartbeats_topic, payload.encode(), self.config.worker_id)
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.config.heartbeat_interval_s - elapsed))

    async def _remove_heartbeat(self) -> None:
        with contextlib.suppress(Exception):
            await self.redis.hdel(self.names.workers_key(self.config.model_name), self.config.worker_id)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"{where}: {err['msg']}"


def _header(record: Any, name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name:
            return value.decode("utf-8", errors="replace")
    return None
