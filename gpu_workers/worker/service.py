"""The GPU worker: consumes a model's request topics, runs the engine, streams events to Redis.

Guarantees it keeps (see DESIGN.md, request flow 3-5):
* tiers drain in order (interactive, standard, batch), and a tier's partitions are paused once the
  worker holds ``max_in_flight`` requests of that tier or above, so the backlog stays in Kafka, not in
  worker memory, and lower-tier work never keeps a higher-tier request out;
* ``max_in_flight`` is a lookahead past the engine's seats, and each request carries its tenant, so the
  engine's fair queuing serves the tenants of a tier evenly over the requests the worker holds;
* an offset is committed only when every request at or below it reached an outcome (``done`` or
  ``error`` in its stream, or a dead letter); a crash or a drain timeout re-delivers the rest;
* a re-delivered request continues from the tokens its stream already holds, with text that joins
  the delivered text exactly (:mod:`.resume`); one whose stream already ended is skipped;
* a cancel (control topic, or the Redis marker checked at pick-up) aborts the engine sequence;
* a message that cannot be decoded or served goes to ``llm.dlq`` with a ``reason`` header;
* final results (``llm.results``) and dead letters are retried until Kafka takes them (at-least-once);
* every event of one flush goes to Redis in one pipelined round trip, with entry ids from ``seq``;
  Redis outages are waited out with backoff, never turned into lost or failed requests.

See docs/reliability.md for the fault tests behind each guarantee.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, InvalidSessionTimeoutError, KafkaError
from pydantic import ValidationError

from gpu_workers.engine import EngineFront, RequestStream
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
    RestartEvent,
    StreamEvent,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
    utcnow,
)
from schemas.events import FinishReason
from schemas.names import HEADER_REASON, HEADER_REQUEST_ID, HEADER_TRACEPARENT, HEADER_TRACESTATE, Tier

from .offsets import CompletionWatermarks
from .prompts import PromptError, prompt_token_ids, sampling_params
from .resume import Continuation
from .streams import REDIS_UNAVAILABLE as _REDIS_DOWN
from .streams import RecordWrite, StreamPublisher, read_pickup_state, read_stream_state

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class WorkerConfig:
    """Knobs of one worker process."""

    model_name: str
    worker_id: str
    # Requests taken from Kafka at one time, counted per tier and above (an interactive request is never
    # kept out by batch work): more than the engine's seats, so its fair queuing sees past a flood.
    max_in_flight: int = 64
    heartbeat_interval_s: float = 2.0
    stream_ttl_s: int = 3600
    drain_timeout_s: float = 30.0
    session_timeout_ms: int = 6000
    heartbeat_ms: int = 1500
    device: str = "cpu"
    redis_retry_max_s: float = 2.0
    commit_interval_s: float = 0.05


@dataclass
class _Active:
    request_id: str
    partition: TopicPartition
    offset: int
    tier: Tier = "batch"
    handed_off: bool = False  # partition revoked: the new owner continues it, emit nothing more
    cancelled: bool = False
    task: asyncio.Task | None = field(default=None, repr=False)
    # The engine request started before the pickup reads answered (see ``Worker._start_early``).
    early: RequestStream | None = field(default=None, repr=False)
    prompt: list[int] | None = field(default=None, repr=False)  # token ids, once computed


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
        engine: EngineFront,
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
        self._eos_ids = engine.eos_token_ids
        self._fatal: BaseException | None = None
        self._commit_task: asyncio.Task[None] | None = None
        # Counters for logs and tests.
        self.served = 0
        self.resumed = 0
        self.dead_lettered = 0
        self.cancelled_before_start = 0

    @property
    def topics(self) -> list[str]:
        return list(self._tiers)

    def rebalance_listener(self) -> ConsumerRebalanceListener:
        return _Rebalance(self)

    # --- main loop ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, *, start_consumer: bool = False) -> None:
        """Serve until ``stop`` is set, then drain in-flight requests and commit.

        With ``start_consumer`` the group consumer is started here, after heartbeats and the control
        consumer are running: joining a group waits for the first assignment, which during a rebalance
        that waits on a dead member takes up to a session timeout, and the worker must not look absent
        (ingress refuses a model without a live heartbeat) nor miss cancels meanwhile.
        """
        loops = [
            asyncio.create_task(self._fetch_loop(start_consumer), name="fetch"),
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
        # Bounded: with Redis down at shutdown, the unflushed requests are simply re-delivered.
        try:
            await asyncio.wait_for(self.publisher.flush(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("worker.final_flush_timed_out", extra={"pending": self.publisher.pending})
        if self._commit_task is not None:
            self._commit_task.cancel()
            await asyncio.gather(self._commit_task, return_exceptions=True)
        await self._commit()

    async def _fetch_loop(self, start_consumer: bool = False) -> None:
        if start_consumer:
            try:
                await self.consumer.start()
            except InvalidSessionTimeoutError as exc:
                raise RuntimeError(
                    f"the Kafka broker refuses a consumer session timeout of {self.config.session_timeout_ms} ms; set "
                    "SLUICEGATE_WORKER_SESSION_TIMEOUT_MS within its group.min.session.timeout.ms and "
                    "group.max.session.timeout.ms"
                ) from exc
            log.info("worker.joined_group", extra={"partitions": len(self.consumer.assignment())})
        while not self._stopping.is_set():
            if self._fatal is not None:
                raise RuntimeError(f"the engine failed; stopping this worker: {self._fatal!r}") from self._fatal
            assigned = self.consumer.assignment()
            rooms = self._rooms()
            open_tps = [tp for tp in assigned if rooms[self._tier_of(tp)] > 0]
            full_tps = [tp for tp in assigned if rooms[self._tier_of(tp)] <= 0]
            # Paused, a full tier's partitions are not fetched: a fetched response left unconsumed would
            # hold back the broker's next fetch (aiokafka's prefetch backoff), and with it interactive requests.
            if full_tps:
                self.consumer.pause(*full_tps)
            if not open_tps:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 0.2)
                continue
            self.consumer.resume(*open_tps)
            for record in await self._fetch_by_tier(open_tps, rooms):
                self._admit(record)

    def _tier_of(self, tp: TopicPartition) -> Tier:
        return self._tiers.get(tp.topic, "batch")

    def _rooms(self) -> dict[Tier, int]:
        """How many more requests each tier may take: ``max_in_flight`` minus those held at that tier or above."""
        held = dict.fromkeys(TIERS, 0)
        for entry in self.active.values():
            held[entry.tier] += 1
        rooms: dict[Tier, int] = {}
        at_or_above = 0
        for tier in TIERS:
            at_or_above += held[tier]
            rooms[tier] = self.config.max_in_flight - at_or_above
        return rooms

    async def _fetch_by_tier(self, open_tps: list[TopicPartition], rooms: dict[Tier, int]) -> list[Any]:
        """Records already fetched for the highest non-empty tier; else wait briefly for any (no tier gets
        more than its room, as taking a request leaves less room for its tier and those below)."""
        by_tier: dict[Tier, list[TopicPartition]] = {t: [] for t in TIERS}
        for tp in open_tps:
            by_tier[self._tier_of(tp)].append(tp)
        for tier in TIERS:
            if by_tier[tier]:
                batch = await self.consumer.getmany(*by_tier[tier], timeout_ms=0, max_records=rooms[tier])
                if batch:
                    return [r for records in batch.values() for r in records]
        batch = await self.consumer.getmany(
            *open_tps, timeout_ms=100, max_records=min(rooms[t] for t in by_tier if by_tier[t])
        )
        records = [r for records in batch.values() for r in records]
        records.sort(key=lambda r: TIERS.index(self._tiers.get(r.topic, "batch")))
        return records

    def _admit(self, record: Any) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self.watermarks.started(tp, record.offset)
        key = f"{tp.topic}:{tp.partition}:{record.offset}"
        # Registered under a provisional key until the request id is known.
        entry = _Active(request_id=key, partition=tp, offset=record.offset, tier=self._tier_of(tp))
        self.active[key] = entry
        parsed: InferenceRequest | _Rejection | Exception
        try:
            parsed = _parse(record)
        except Exception as exc:  # reported by the request's task, like any failure to serve it
            parsed = exc
        if isinstance(parsed, InferenceRequest) and self._claim_at_once(entry, key, parsed.request_id):
            # The engine starts here rather than in the request's task: that task runs only after the fetch loop
            # and the consumer's next fetch have had the event loop.
            try:
                entry.early = self._start_early(parsed, entry)
            except Exception:  # the task meets the same failure again and reports it there
                entry.early = None
        entry.task = asyncio.create_task(self._serve(tp, record, entry, parsed), name=key)

    # --- one request ---------------------------------------------------------------------------------
    async def _serve(
        self, tp: TopicPartition, record: Any, entry: _Active, parsed: InferenceRequest | _Rejection | Exception
    ) -> None:
        provisional = f"{tp.topic}:{tp.partition}:{record.offset}"
        # Only a request that reached an outcome (done/error in its stream, dead-lettered, or skipped)
        # lets its offset be committed; anything else is re-delivered to the partition's next owner.
        completed = False
        try:
            if isinstance(parsed, Exception):
                raise parsed
            if isinstance(parsed, _Rejection):
                await self._dead_letter(record, parsed.reason, parsed.detail, parsed.request_id)
                completed = True
                return
            if entry.request_id != parsed.request_id and not await self._claim(entry, provisional, parsed.request_id):
                completed = True  # a duplicate of a request this worker is running
                return
            completed = await self._serve_request(parsed, entry, record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self.engine.is_running:
                # The engine itself is gone: leave the request to a healthy worker and stop this one.
                log.error("worker.engine_failed", extra={"error": repr(exc)})
                self._fatal = exc
                return
            log.exception("worker.request_failed", extra={"offset": record.offset})
            if entry.request_id != provisional:
                await self._fail(entry, "internal_error", f"the worker failed to serve the request: {exc!r}")
            await self._dead_letter(record, "processing_failed", repr(exc), _request_id_of(record))
            completed = True
        finally:
            for key in (entry.request_id, provisional):
                if self.active.get(key) is entry:
                    del self.active[key]
            if completed and not entry.handed_off:
                self.watermarks.finished(tp, record.offset)
                self._schedule_commit()
            self._room.set()

    def _claim_at_once(self, entry: _Active, provisional: str, request_id: str) -> bool:
        """Register ``entry`` under its request id when no other entry holds it (else ``_claim`` decides)."""
        if request_id in self.active:
            return False
        entry.request_id = request_id
        self.active[request_id] = self.active.pop(provisional)
        return True

    async def _claim(self, entry: _Active, provisional: str, request_id: str) -> bool:
        """Register ``entry`` under its request id; False for a duplicate of a request still running here.

        After a rebalance gives a partition back to this worker, its handed-off task for the same
        request may still be unwinding (its engine abort in flight): wait for it, then take over.
        """
        while (other := self.active.get(request_id)) is not None and other is not entry:
            if not other.handed_off:
                log.warning("worker.duplicate_request", extra={"request_id": request_id, "offset": entry.offset})
                return False
            if other.task is None or other.task.done():
                del self.active[request_id]
            else:
                await asyncio.wait({other.task})
        return self._claim_at_once(entry, provisional, request_id)

    async def _serve_request(self, request: InferenceRequest, entry: _Active, record: Any) -> bool:
        """Serve one parsed request; True when it reached an outcome, False when handed off mid-way.

        The engine starts on the request while its pickup state is read from Redis, so that round trip
        overlaps the prefill instead of preceding it. Nothing the early start produces is emitted before the
        state says the request is new; otherwise the early start is withdrawn and the state decides.
        """
        if entry.early is None:
            entry.early = self._start_early(request, entry)
        try:
            return await self._serve_picked_up(request, entry, record)
        finally:
            if entry.early is not None:
                await self._withdraw(entry.early)
                entry.early = None

    def _start_early(self, request: InferenceRequest, entry: _Active) -> RequestStream | None:
        """Start the engine on a request that looks new; None when anything says it should wait."""
        rid = request.request_id
        if entry.cancelled or entry.handed_off or rid in self._early_cancels or request.expired():
            return None
        try:
            entry.prompt = prompt_token_ids(request, self.engine.tokenizer)
            return self.engine.add_request(
                entry.prompt,
                sampling_params(request, 0),
                request_id=rid,
                priority=request.priority,
                tenant=request.tenant,
            )
        except (PromptError, ValueError):
            return None  # the regular path reports it, after the pickup state is known

    async def _withdraw(self, stream: RequestStream) -> None:
        """Abort an engine request nobody will read and wait for its end, so its id is free again."""
        if stream.finished:
            return
        with contextlib.suppress(Exception):
            await self.engine.abort(stream.request_id)
            async for _ in stream:
                pass

    async def _serve_picked_up(self, request: InferenceRequest, entry: _Active, record: Any) -> bool:
        rid = request.request_id
        pickup = await self._redis_call(lambda: read_pickup_state(self.redis, self.names, rid))
        state, ended_before = pickup.stream, _record_says_ended(pickup.record)
        if state.finished:
            # Re-delivered after it finished but before its offset was committed.
            log.info("worker.already_finished", extra={"request_id": rid})
            if state.done is not None and not ended_before:
                # The previous owner died between ``done`` and its final result: publish that now
                # (llm.results is at-least-once, keyed by request id).
                await self._publish_result(request, state.done, state.token_ids, state.text)
            return True
        if not state.exists and ended_before:
            return True  # it finished long ago and its stream expired
        seq = state.next_seq
        if self._cancel_requested(entry, pickup.cancel_marked):
            self.cancelled_before_start += 1
            log.info("worker.cancelled_before_start", extra={"request_id": rid, "delivered": state.delivered})
            prompt_len = _prompt_len_or_zero(request, self.engine.tokenizer)
            return await self._finish(entry, request, seq, "abort", state.token_ids, state.text, prompt_len, 0)
        if not state.exists and request.expired():
            assert request.deadline is not None
            detail = f"deadline {request.deadline.isoformat()} passed before the request started"
            if not await self._fail(entry, "deadline_exceeded", "the request's deadline passed before it started", seq):
                return False
            await self._dead_letter(record, "deadline_exceeded", detail, rid)
            return True
        try:
            prompt = entry.prompt if entry.prompt is not None else prompt_token_ids(request, self.engine.tokenizer)
        except PromptError as exc:
            if not await self._fail(entry, "invalid_request", str(exc), seq):
                return False
            await self._dead_letter(record, "invalid_prompt", str(exc), rid)
            return True

        resumed: Continuation | None = None
        if state.delivered:
            resumed = Continuation(request, self.engine.tokenizer, prompt, state.token_ids, state.text, self._eos_ids)
            if not resumed.consistent:
                # The delivered text is not what this model's tokenizer makes of the delivered tokens, so
                # no seamless continuation exists: start over and tell clients to drop what they have.
                log.warning("worker.restart", extra={"request_id": rid, "delivered": state.delivered})
                if not self._emit(entry, RestartEvent(request_id=rid, seq=seq, discard_after_seq=-1)):
                    return False
                seq += 1
                resumed = None
            else:
                self.resumed += 1
                log.info("worker.resuming", extra={"request_id": rid, "delivered": state.delivered, "seq": seq})
                ended = resumed.finished_already()
                if ended is not None:
                    # The previous owner died between the last token and ``done``.
                    resumed.close(ended)
                    tail = resumed.take(final=True)
                    if tail:
                        if not self._emit(entry, TokenEvent(request_id=rid, seq=seq, text=tail, token_ids=[])):
                            return False
                        seq += 1
                    return await self._finish(
                        entry, request, seq, ended, resumed.token_ids, resumed.text, len(prompt), 0
                    )
        return await self._generate(request, entry, record, prompt, seq, resumed)

    async def _generate(
        self,
        request: InferenceRequest,
        entry: _Active,
        record: Any,
        prompt: list[int],
        seq: int,
        resumed: Continuation | None,
    ) -> bool:
        rid = request.request_id
        if resumed is not None and entry.early is not None:
            await self._withdraw(entry.early)  # it started from the bare prompt; the resume needs more
            entry.early = None
        # Written with the first token's append rather than awaited here: one round trip less before the
        # engine starts, and still ahead of the final record (which waits for a flush).
        if not self._emit(entry, self._record_write(request, "running")):
            return False
        delivered = list(resumed.token_ids) if resumed is not None else []
        tokens, text = list(delivered), resumed.text[: resumed.sent] if resumed is not None else ""
        finish: FinishReason = "stop"
        cached = 0
        started = False
        # No await between this check and the engine taking the request (an early start has it already;
        # ``add_request`` queues it at once), so a cancel is either seen here or reaches the engine.
        if entry.cancelled:
            return await self._finish(entry, request, seq, "abort", tokens, text, len(prompt), 0)
        try:
            deltas, entry.early = entry.early, None
            if deltas is None:
                params = sampling_params(request, len(delivered))
                deltas = self.engine.add_request(
                    prompt + delivered, params, request_id=rid, priority=request.priority, tenant=request.tenant
                )
            async with self._reading(deltas):
                async for delta in deltas:
                    started = True
                    if entry.handed_off:
                        return False
                    cached = getattr(delta, "num_cached_tokens", cached) or cached
                    reason: FinishReason | None = delta.finish_reason
                    if resumed is None:
                        piece = delta.text
                        tokens.extend(delta.token_ids)
                    else:
                        if resumed.feed(delta.token_ids):
                            reason = "stop"  # a stop string across the resume point: the engine cannot see it
                        if reason is not None:
                            resumed.close(reason)
                        piece = resumed.take(final=reason is not None)
                        tokens = resumed.token_ids
                    text += piece
                    if piece or delta.token_ids:
                        event = TokenEvent(request_id=rid, seq=seq, text=piece, token_ids=list(delta.token_ids))
                        if not self._emit(entry, event):
                            return False
                        seq += 1
                    if reason is not None:
                        finish = reason
                        break  # leaving the block aborts the engine request if it is still running
        except ValueError as exc:
            if started:
                raise
            # The engine refused the request outright (e.g. prompt + max_tokens over the context length).
            code = "context_length_exceeded" if "max_model_len" in str(exc) else "invalid_request"
            if not await self._fail(entry, code, str(exc), seq):
                return False
            await self._dead_letter(record, "rejected_by_engine", str(exc), rid)
            return True
        if entry.handed_off:
            return False
        return await self._finish(entry, request, seq, finish, list(tokens), text, len(prompt), cached)

    async def _finish(
        self,
        entry: _Active,
        request: InferenceRequest,
        seq: int,
        reason: FinishReason,
        tokens: list[int],
        text: str,
        prompt_tokens: int,
        cached: int,
    ) -> bool:
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(tokens),
            total_tokens=prompt_tokens + len(tokens),
            cached_tokens=cached,
        )
        done = DoneEvent(request_id=request.request_id, seq=seq, finish_reason=reason, usage=usage)
        if not self._emit(entry, done):
            return False
        # The stream must hold ``done`` before the offset can be committed.
        await self.publisher.flush()
        await self._publish_result(request, done, tokens, text)
        self.served += 1
        return True

    async def _publish_result(self, request: InferenceRequest, done: DoneEvent, tokens: list[int], text: str) -> None:
        """The final result to ``llm.results``, then the status record; a record that says the request
        ended therefore means its result went out."""
        result = FinalResult(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            text=text,
            token_ids=tokens,
            finish_reason=done.finish_reason,
            usage=done.usage,
            worker_id=self.config.worker_id,
            created_at=request.created_at,
        )
        await self._send(self.names.results_topic, result.model_dump_json().encode(), request.request_id)
        status = "cancelled" if done.finish_reason == "abort" else "finished"
        await self._set_record(request, status, result)

    async def _fail(self, entry: _Active, code: str, message: str, seq: int | None = None) -> bool:
        """End the request's stream with an ``error`` event; False when it was handed off meanwhile."""
        request_id = entry.request_id
        if seq is None:
            seq = (await self._redis_call(lambda: read_stream_state(self.redis, self.names, request_id))).next_seq
        if not self._emit(entry, ErrorEvent(request_id=request_id, seq=seq, code=code, message=message[:2000])):
            return False
        await self.publisher.flush()
        raw = await self._redis_call(lambda: self.redis.get(self.names.request_key(request_id)))
        if raw is not None:
            record = RequestRecord.model_validate_json(raw)
            update = record.model_copy(update={"status": "failed", "updated_at": utcnow()})
            await self._redis_call(
                lambda: self.redis.set(self.names.request_key(request_id), update.model_dump_json(), keepttl=True)
            )
        return True

    @contextlib.asynccontextmanager
    async def _reading(self, stream: RequestStream) -> AsyncIterator[RequestStream]:
        """Read an engine request's deltas; leaving early (a stop string, a hand-off, an error) aborts it.

        The request's task ends only once the engine has let go of the id: a partition handed off and assigned
        back re-delivers the same request, which must find the id free (with an engine process the abort's
        answer takes a round trip, so the old task would otherwise be gone while the engine still held it).
        """
        try:
            yield stream
        finally:
            await self._withdraw(stream)

    def _emit(self, entry: _Active, event: StreamEvent | RecordWrite) -> bool:
        """Queue one event (or status-record write) for the next flush, unless the request was handed to
        another owner.

        Every append goes through here with no await between the check and the add, so once
        :meth:`hand_off` has flushed, nothing more is written for a request that moved away.
        """
        if entry.handed_off:
            return False
        self.publisher.add(event)
        self._events.set()
        return True

    def _cancel_requested(self, entry: _Active, cancel_marked: bool) -> bool:
        """A cancel seen on the control topic (before or after pick-up) or marked in Redis."""
        rid = entry.request_id
        if rid in self._early_cancels:
            del self._early_cancels[rid]
            entry.cancelled = True
        return entry.cancelled or cancel_marked

    async def _set_record(self, request: InferenceRequest, status: str, result: FinalResult | None = None) -> None:
        write = self._record_write(request, status, result)
        await self._redis_call(lambda: self.redis.set(write.key, write.value, ex=write.ttl_s))

    def _record_write(self, request: InferenceRequest, status: str, result: FinalResult | None = None) -> RecordWrite:
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
        key = self.names.request_key(request.request_id)
        return RecordWrite(key, record.model_dump_json(), self.config.stream_ttl_s)

    async def _redis_call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis operation, retrying with backoff while Redis is unreachable (a restart, a failover).

        The request waits rather than failing: its offset stays uncommitted, so nothing is lost either way.
        """
        delay = 0.05
        while True:
            try:
                return await call()
            except _REDIS_DOWN as exc:
                log.warning("worker.redis_unavailable", extra={"error": str(exc), "retry_in_s": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.redis_retry_max_s)

    async def _dead_letter(self, record: Any, reason: str, detail: str, request_id: str | None) -> None:
        """Put the record on ``llm.dlq`` with its reason; retried until Kafka takes it (the offset waits)."""
        raw = record.value or b""
        letter = DeadLetter(
            reason=reason,
            detail=detail[:4000],
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            payload=raw.decode("utf-8", errors="replace"),
            request_id=request_id,
        )
        headers = [(HEADER_REASON, reason.encode())]
        if request_id:
            headers.append((HEADER_REQUEST_ID, request_id.encode()))
        headers += [(k, v) for k, v in record.headers or () if k in (HEADER_TRACEPARENT, HEADER_TRACESTATE)]
        await self._send(self.names.dlq_topic, letter.model_dump_json().encode(), request_id, headers)
        self.dead_lettered += 1
        log.warning(
            "worker.dead_letter",
            extra={"reason": reason, "detail": detail[:200], "topic": record.topic, "offset": record.offset},
        )

    async def _send(
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

    # --- background loops --------------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while True:
            await self._events.wait()
            self._events.clear()
            # Let every request whose delta came out of the same engine step add its event first.
            await asyncio.sleep(0)
            await self.publisher.flush()

    def _schedule_commit(self) -> None:
        """Commit soon, once for all requests finishing within ``commit_interval_s``: a commit per request
        costs the broker and this event loop a round trip each, on the machine that serves first tokens."""
        if self._commit_task is None or self._commit_task.done():
            self._commit_task = asyncio.create_task(self._commit_later(), name="worker-commit")

    async def _commit_later(self) -> None:
        await asyncio.sleep(self.config.commit_interval_s)
        await self._commit()

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
            log.info("worker.cancel", extra={"request_id": cancel.request_id, "reason": cancel.reason})
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
            if not self.engine.is_running:
                # An engine that died while idle: stop advertising this worker and let another take its partitions.
                raise RuntimeError("the engine stopped; stopping this worker")
            beat = self.heartbeat()
            payload = beat.model_dump_json()
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(self.names.workers_key(self.config.model_name), self.config.worker_id, payload)
                pipe.sadd(self.names.models_key, self.config.model_name)
                await pipe.execute()
            except _REDIS_DOWN as exc:
                # Skipped, not fatal: the next beat goes out once Redis is back.
                log.warning("worker.heartbeat_redis_failed", extra={"error": str(exc)})
            # Not awaited: a slow Kafka acknowledgement must not delay the next beat that routing reads.
            try:
                sent = await self.producer.send(
                    self.names.heartbeats_topic, payload.encode(), key=self.config.worker_id.encode()
                )
                sent.add_done_callback(_log_send_failure)
            except KafkaError as exc:
                log.warning("worker.heartbeat_kafka_failed", extra={"error": repr(exc)})
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.config.heartbeat_interval_s - elapsed))

    async def _remove_heartbeat(self) -> None:
        with contextlib.suppress(Exception):
            await self.redis.hdel(self.names.workers_key(self.config.model_name), self.config.worker_id)


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("worker.heartbeat_kafka_failed", extra={"error": repr(future.exception())})


@dataclass(frozen=True)
class _Rejection:
    """Why a record is not a request; ``reason`` matches the router's DLQ reasons."""

    reason: str
    detail: str
    request_id: str | None


def _parse(record: Any) -> InferenceRequest | _Rejection:
    raw = record.value
    if not raw:
        return _Rejection("empty_message", "the record has no value", _header(record, HEADER_REQUEST_ID))
    try:
        return InferenceRequest.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            return _Rejection("invalid_json", f"not valid JSON: {error['msg']}", _header(record, HEADER_REQUEST_ID))
        if error["type"] == "model_type" and not error["loc"]:
            return _Rejection("not_an_object", error["msg"], _header(record, HEADER_REQUEST_ID))
        # Errors about the message as a whole (prompt vs messages) are reported on "prompt", as the router does.
        where = _field_path(error["loc"]) or "prompt"
        return _Rejection(f"schema_violation:{where}", f"{where}: {error['msg']}", _request_id_of(record))


# Union branches appear in an error location under their type ("str", "list[int]", "function-after[...]").
_BRANCH = re.compile(r"[\[\]\-]|^(str|int|float|bool|bytes|list|dict|none)$")


def _record_says_ended(raw: bytes | None) -> bool:
    """Whether a status record says the request ended (its stream may since have expired)."""
    if raw is None:
        return False
    try:
        status = RequestRecord.model_validate_json(raw).status
    except ValidationError:
        return False
    return status in ("finished", "cancelled", "failed")


def _field_path(loc: tuple[int | str, ...]) -> str:
    """The dotted field path of a validation error, without union branch labels."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or not _BRANCH.search(p))


def _request_id_of(record: Any) -> str | None:
    """The request id from the header, else from the JSON body when there is one."""
    rid = _header(record, HEADER_REQUEST_ID)
    if rid:
        return rid
    try:
        body = json.loads(record.value or b"")
    except ValueError:
        return None
    value = body.get("request_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


def _prompt_len_or_zero(request: InferenceRequest, tokenizer: Any) -> int:
    try:
        return len(prompt_token_ids(request, tokenizer))
    except PromptError:
        return 0


def _header(record: Any, name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name and value is not None:
            return value.decode("utf-8", errors="replace")
    return None
