"""Helpers shared by the ingress integration tests: a real uvicorn server for an ingress app, the Redis writes a
live worker makes (heartbeats), a fake worker that answers requests through real Kafka and Redis, and readers.

The fake worker is a real aiokafka consumer appending real stream events to Redis, as the GPU worker does; it
stands in for the engine so the HTTP side can be exercised end to end without a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import uvicorn
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from redis.asyncio import Redis

from gpu_workers.worker.heartbeat import model_tokenizer
from ingress.app import create_app
from schemas import (
    STREAM_FIELD,
    DoneEvent,
    ErrorEvent,
    InferenceRequest,
    Names,
    PartitionRef,
    ReasoningParser,
    RequestRecord,
    RequestStatus,
    RestartEvent,
    Tier,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
    encode_embedding,
    stream_entry_id,
    utcnow,
)
from sluicegate.kafka import create_admin, create_consumer, ensure_topics
from sluicegate.settings import Settings
from sluicegate.task_stop import cancel_and_wait

MODEL = "tiny-llama"
KEY = "sk-integration-key"
CAPPED_KEY = "sk-capped-standard"


@contextlib.asynccontextmanager
async def running_app(app: Any) -> AsyncIterator[str]:
    """A real uvicorn server for an ASGI app on a free port, on this event loop; yields its base URL."""
    # Shutdown bounded as the services' own servers bound it (ingress/server.py): a streaming connection still
    # open at teardown is closed after the grace instead of holding the test forever (a CI teardown hung 120 s).
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while not server.started:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "server did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def running_ingress(settings: Settings) -> AsyncIterator[str]:
    """A real ingress (uvicorn) for ``settings`` on a free port, on this event loop."""
    async with running_app(create_app(settings)) as url:
        yield url


async def heartbeat(
    redis: Redis,
    names: Names,
    model: str = MODEL,
    *,
    age_s: float = 0.0,
    worker: str = "w1",
    running: int = 0,
    waiting: int = 0,
    description: str | None = None,
    backlog_seconds: dict[Tier, float] | None = None,
    lora: bool = False,
    reasoning_parser: ReasoningParser | None = None,
    architecture: str | None = None,
) -> None:
    """What a live worker writes to Redis every heartbeat interval (``lora``: it serves LoRA adapters)."""
    beat = WorkerHeartbeat(
        worker_id=worker,
        model=model,
        partitions=[PartitionRef(topic=names.request_topic(model, "standard"), partition=0)],
        running=running,
        waiting=waiting,
        free_kv_blocks=100,
        total_kv_blocks=100,
        prefix_cache_hit_rate=0.0,
        sent_at=utcnow() - timedelta(seconds=age_s),
        description=description,
        backlog_seconds=backlog_seconds,
        lora=lora,
        reasoning_parser=reasoning_parser,
        architecture=architecture,
    )
    await redis.hset(names.workers_key(model), worker, beat.model_dump_json())
    await redis.sadd(names.models_key, model)


def reply_for(request: InferenceRequest) -> list[str]:
    """The fake model's answer, as text pieces: it repeats the last user text, word by word."""
    if request.messages is not None:
        said = request.messages[-1].text()
    else:
        said = request.prompt if isinstance(request.prompt, str) else " ".join(map(str, request.prompt or []))
    words = f"You said: {said}".split(" ")
    return [words[0]] + [f" {w}" for w in words[1:]]


@functools.cache
def _fake_tokenizer() -> Any:
    """A small trained byte-level tokenizer with the tiny models' chat template (built once per process)."""
    from gpu_workers.engine.models.random_checkpoint import CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(512)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class FakeWorker:
    """Reads the model's request topics (all partitions, no group) and answers each request with token
    events and a ``done`` on its Redis stream. ``mode="restart"`` emits a restart and regenerates;
    ``mode="hang"`` sends one token then waits for the cancel marker and ends with ``abort``; ``mode="fail"`` ends
    the stream with an ``internal_error`` at once. ``reply`` replaces
    :func:`reply_for` (the text pieces to answer with); ``token_delay_s`` is the pause after each piece."""

    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        *,
        mode: str = "normal",
        reply: Callable[[InferenceRequest], list[str]] | None = None,
        token_delay_s: float = 0.005,
    ) -> None:
        self.settings = settings
        self.names = Names(settings.topic_prefix)
        self.redis = redis
        self.mode = mode
        self.reply = reply or reply_for
        self.token_delay_s = token_delay_s
        self.seen: list[tuple[ConsumerRecord, InferenceRequest]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> FakeWorker:
        # As a worker does at start: its tokenizer and chat template, for ingress's exact counts and /tokenize.
        published = model_tokenizer(MODEL, _fake_tokenizer(), max_model_len=None)
        assert published is not None
        await self.redis.set(self.names.tokenizer_key(MODEL), published)
        topics = self.names.request_topics(MODEL)
        await ensure_topics(self.settings.kafka_bootstrap, dict.fromkeys(topics, self.settings.topic_partitions), 1)
        self._consumer = create_consumer(group_id=None, settings=self.settings)
        await self._consumer.start()
        self._consumer.assign([TopicPartition(t, p) for t in topics for p in range(self.settings.topic_partitions)])
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._consumer is not None
        tasks = (self._task, *self._answers)
        await cancel_and_wait(*tasks)
        for task in tasks:
            if not task.cancelled():
                task.result()  # a fake answer that failed fails the test
        await self._consumer.stop()

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            batch = await self._consumer.getmany(timeout_ms=100)
            for records in batch.values():
                for record in records:
                    request = InferenceRequest.model_validate_json(record.value)
                    self.seen.append((record, request))
                    answer = asyncio.create_task(self._answer(request))
                    self._answers.add(answer)

    async def _append(self, request: InferenceRequest, event: Any) -> None:
        await self.redis.xadd(
            self.names.stream_key(request.request_id),
            {STREAM_FIELD: event.model_dump_json()},
            id=stream_entry_id(event.seq),
        )

    async def _set_status(self, request: InferenceRequest, status: RequestStatus) -> None:
        record = RequestRecord(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            priority=request.priority,
            status=status,
            created_at=request.created_at,
        )
        await self.redis.set(self.names.request_key(request.request_id), record.model_dump_json(), ex=600)

    async def _answer(self, request: InferenceRequest) -> None:
        rid = request.request_id
        pieces = whole = self.reply(request)
        reason = "stop"
        if len(pieces) > request.sampling.max_tokens:
            pieces, reason = pieces[: request.sampling.max_tokens], "length"
        seq = 0
        if request.task == "embed":  # one done event carrying a vector, as a worker answers an embedding
            tokens = len(request.prompt or "")
            usage = Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
            vector = encode_embedding([0.6, 0.8])
            await self._append(
                request, DoneEvent(request_id=rid, seq=0, finish_reason="stop", usage=usage, embedding=vector)
            )
            return
        if self.mode == "fail":
            await self._append(request, ErrorEvent(request_id=rid, seq=0, code="internal_error", message="it broke"))
            return
        if self.mode == "hang":
            # Its status record as a worker keeps it: running (written a moment after its first token, as a worker's
            # rides a later flush), then cancelled once the abort is on the stream.
            await self._append(request, TokenEvent(request_id=rid, seq=0, text=pieces[0], token_ids=[1]))
            await asyncio.sleep(0.3)
            await self._set_status(request, "running")
            await eventually(lambda: self.redis.exists(self.names.cancel_key(rid)), timeout_s=60)
            usage = Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
            await self._append(request, DoneEvent(request_id=rid, seq=1, finish_reason="abort", usage=usage))
            await self._set_status(request, "cancelled")
            return
        if self.mode == "restart":
            # A crashed first attempt: two pieces, then "start over after seq 0".
            for text in pieces[:2]:
                await self._append(request, TokenEvent(request_id=rid, seq=seq, text=text, token_ids=[seq]))
                seq += 1
            await self._append(request, RestartEvent(request_id=rid, seq=seq, discard_after_seq=0))
            seq += 1
            pieces = pieces[1:]
        for text in pieces:
            await self._append(request, TokenEvent(request_id=rid, seq=seq, text=text, token_ids=[seq]))
            seq += 1
            await asyncio.sleep(self.token_delay_s)
        completion = len(whole) if reason == "stop" else request.sampling.max_tokens
        usage = Usage(prompt_tokens=7, completion_tokens=completion, total_tokens=7 + completion, cached_tokens=2)
        await self._append(request, DoneEvent(request_id=rid, seq=seq, finish_reason=reason, usage=usage))
        await self.redis.expire(self.names.stream_key(rid), 60)


async def consume(consumer: AIOKafkaConsumer, count: int, timeout_s: float = 20.0) -> list[ConsumerRecord]:
    records: list[ConsumerRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        for batch in (await consumer.getmany(timeout_ms=200)).values():
            records.extend(batch)
    assert len(records) >= count, f"expected {count} records, got {len(records)}"
    return records


async def consume_cancels(consumer: AIOKafkaConsumer, count: int, timeout_s: float = 20.0) -> list[ConsumerRecord]:
    """``count`` cancels from a control topic, past the KV-snapshot requests that share it (a router or ingress
    following the fleet's KV events asks for snapshots there when it starts)."""
    records: list[ConsumerRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count and time.monotonic() < deadline:
        for batch in (await consumer.getmany(timeout_ms=200)).values():
            records.extend(r for r in batch if b'"kind":"kv_snapshot"' not in (r.value or b""))
    assert len(records) >= count, f"expected {count} cancels, got {len(records)}"
    return records[:count]


@contextlib.asynccontextmanager
async def reader(settings: Settings, *topics: str, partitions: int) -> AsyncIterator[AIOKafkaConsumer]:
    """A group-less consumer on every partition of ``topics``, from the beginning."""
    await ensure_topics(settings.kafka_bootstrap, dict.fromkeys(topics, partitions), 1)
    consumer = create_consumer(group_id=None, settings=settings)
    await consumer.start()
    consumer.assign([TopicPartition(t, p) for t in topics for p in range(partitions)])
    try:
        yield consumer
    finally:
        await consumer.stop()


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def wait_partitions_owned(redis: Redis, settings: Settings, model: str, *tasks: asyncio.Task) -> None:
    """Until a worker of ``model`` heartbeats with partitions of its own; a task of ``tasks`` (the services under
    test) ending first fails with its exception."""

    async def owned() -> bool:
        for task in tasks:
            assert not task.done(), task.exception()
        beats = await redis.hgetall(settings.names.workers_key(model))
        return any(WorkerHeartbeat.model_validate_json(v).partitions for v in beats.values())

    await eventually(owned, timeout_s=120)


async def delete_prefixed_keys(redis: Redis, prefix: str) -> None:
    """Delete every Redis key under ``prefix``."""
    keys = [k async for k in redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis.delete(*keys)


async def delete_prefixed_topics(bootstrap: str, prefix: str) -> None:
    """Delete every Kafka topic whose name starts with ``prefix``."""
    admin = create_admin(bootstrap=bootstrap)
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith(prefix)]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()
