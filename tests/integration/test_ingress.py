"""Ingress and the router stream processor on a real Kafka broker and Redis server.

A small fake worker (a real aiokafka consumer that answers requests by appending real stream events to
Redis, as the GPU worker does) stands in for the engine, so the official ``openai`` client is exercised
end to end: publish, route, tail, convert.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from redis.asyncio import Redis

from ingress.app import create_app
from ingress.auth import hash_key
from router import KeyPolicy
from router.policy import affinity_prefix, key_partition, partition_key
from router.stream import run_router
from schemas import (
    STREAM_FIELD,
    CancelRequest,
    DeadLetter,
    DoneEvent,
    FinalResult,
    InferenceRequest,
    Names,
    PartitionRef,
    RequestRecord,
    RestartEvent,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
    stream_entry_id,
    utcnow,
)
from sluicegate.kafka import create_admin, create_consumer, create_producer, ensure_topics
from sluicegate.settings import Settings
from sluicegate.stream_tokens import verify_stream_token

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "tiny-llama"
KEY = "sk-integration-key"
CAPPED_KEY = "sk-capped-standard"
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


# --- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture
def settings(test_settings: Settings, tmp_path: Path) -> Settings:
    keys = tmp_path / "keys.jsonl"
    keys.write_text(json.dumps({"key": CAPPED_KEY, "tenant": "capped", "max_tier": "standard"}) + "\n")
    return test_settings.model_copy(
        update={
            "api_keys": KEY,
            "api_keys_file": keys,
            "stream_token_secret": "integration-secret",
            "topic_partitions": 3,
            "heartbeat_interval_s": 1.0,
            "kafka_timeout_s": 5.0,
            "request_timeout_s": 30.0,
            "public_stream_url": "ws://results.example:8001",
        }
    )


@pytest.fixture
async def redis(redis_url: str, unique_prefix: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{unique_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
async def cleanup_topics(kafka_bootstrap: str, unique_prefix: str) -> AsyncIterator[None]:
    """Deletes every topic this test created (they all carry its prefix)."""
    yield
    admin = create_admin(bootstrap=kafka_bootstrap)
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith(unique_prefix)]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def running_ingress(settings: Settings) -> AsyncIterator[str]:
    """A real uvicorn server on a free port, on this event loop."""
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_config=None))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while not server.started:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "ingress did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def ingress(settings: Settings, cleanup_topics: None) -> AsyncIterator[str]:
    async with running_ingress(settings) as url:
        yield url


async def heartbeat(redis: Redis, names: Names, model: str = MODEL, *, age_s: float = 0.0, worker: str = "w1") -> None:
    """What a live worker writes to Redis every heartbeat interval."""
    beat = WorkerHeartbeat(
        worker_id=worker,
        model=model,
        partitions=[PartitionRef(topic=names.request_topic(model, "standard"), partition=0)],
        running=0,
        waiting=0,
        free_kv_blocks=100,
        total_kv_blocks=100,
        prefix_cache_hit_rate=0.0,
        sent_at=utcnow() - timedelta(seconds=age_s),
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


class FakeWorker:
    """Reads the model's request topics (all partitions, no group) and answers each request with token
    events and a ``done`` on its Redis stream. ``mode="restart"`` emits a restart and regenerates;
    ``mode="hang"`` sends one token then waits for the cancel marker and ends with ``abort``."""

    def __init__(self, settings: Settings, redis: Redis, *, mode: str = "normal") -> None:
        self.settings = settings
        self.names = Names(settings.topic_prefix)
        self.redis = redis
        self.mode = mode
        self.seen: list[tuple[ConsumerRecord, InferenceRequest]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> FakeWorker:
        topics = self.names.request_topics(MODEL)
        await ensure_topics(self.settings.kafka_bootstrap, dict.fromkeys(topics, self.settings.topic_partitions), 1)
        self._consumer = create_consumer(group_id=None, settings=self.settings)
        await self._consumer.start()
        self._consumer.assign([TopicPartition(t, p) for t in topics for p in range(self.settings.topic_partitions)])
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._consumer is not None
        for task in (self._task, *self._answers):
            task.cancel()
        for task in (self._task, *self._answers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
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

    async def _answer(self, request: InferenceRequest) -> None:
        rid = request.request_id
        pieces = reply_for(request)
        reason = "stop"
        if len(pieces) > request.sampling.max_tokens:
            pieces, reason = pieces[: request.sampling.max_tokens], "length"
        seq = 0
        if self.mode == "hang":
            await self._append(request, TokenEvent(request_id=rid, seq=0, text=pieces[0], token_ids=[1]))
            await eventually(lambda: self.redis.exists(self.names.cancel_key(rid)), timeout_s=60)
            usage = Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
            await self._append(request, DoneEvent(request_id=rid, seq=1, finish_reason="abort", usage=usage))
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
            await asyncio.sleep(0.005)
        completion = len(reply_for(request)) if reason == "stop" else request.sampling.max_tokens
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


# --- publishing ---------------------------------------------------------------------------------------------
async def test_native_submit_publishes_routed_request_with_headers(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "priority": "interactive",
        "deadline": 60,
        "ignore_eos": True,
    }
    caller_trace = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    async with httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as http:
        response = await http.post("/v1/requests", json=body, headers={"traceparent": caller_trace})
    assert response.status_code == 202, response.text
    submitted = response.json()
    rid = submitted["request_id"]
    assert submitted["stream_url"] == f"ws://results.example:8001/v1/streams/{rid}"
    tenant = f"key-{hash_key(KEY)[:8]}"
    assert verify_stream_token("integration-secret", rid, submitted["stream_token"]) == tenant

    async with reader(settings, names.request_topic(MODEL, "interactive"), partitions=3) as consumer:
        (record,) = await consume(consumer, 1)
    request = InferenceRequest.model_validate_json(record.value)
    assert (request.request_id, request.tenant, request.priority) == (rid, tenant, "interactive")
    assert request.messages is not None and request.messages[0].content == "You are terse."
    assert request.sampling.max_tokens == 5 and request.sampling.ignore_eos and request.deadline is not None
    assert record.key == partition_key(MODEL, affinity_prefix(request, KeyPolicy()))
    headers = {k: v.decode() for k, v in record.headers}
    assert headers["request_id"] == rid
    assert TRACEPARENT.match(headers["traceparent"])
    # The ingress span continues the caller's trace.
    assert headers["traceparent"].split("-")[1] == "ab" * 16 and headers["traceparent"] != caller_trace
    assert request.trace is not None and request.trace.traceparent == headers["traceparent"]

    stored = RequestRecord.model_validate_json(await redis.get(names.request_key(rid)))
    assert (stored.status, stored.tenant, stored.priority) == ("queued", tenant, "interactive")
    assert 0 < await redis.ttl(names.request_key(rid)) <= settings.request_record_ttl_s


async def test_capped_key_lands_on_standard_and_shares_partition_for_shared_system_prompt(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    system = {"role": "system", "content": "A long shared preamble. " * 20}
    async with httpx.AsyncClient(base_url=ingress, headers={"Authorization": f"Bearer {CAPPED_KEY}"}) as http:
        for question in ("What is Kafka?", "And Redis?", "Why both?"):
            body = {"model": MODEL, "messages": [system, {"role": "user", "content": question}]}
            response = await http.post("/v1/requests", json=body | {"priority": "interactive"})
            assert response.status_code == 202, response.text
            assert response.json()["priority"] == "standard"
    async with reader(settings, names.request_topic(MODEL, "standard"), partitions=3) as consumer:
        records = await consume(consumer, 3)
    assert len({(r.partition, r.key) for r in records}) == 1
    assert {InferenceRequest.model_validate_json(r.value).tenant for r in records} == {"capped"}


async def test_overloaded_owner_diverts_to_an_idle_workers_partition(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    names = Names(settings.topic_prefix)
    topic = names.request_topic(MODEL, "standard")
    probe = InferenceRequest(request_id="probe", model=MODEL, prompt="divert me")
    key = partition_key(MODEL, affinity_prefix(probe, KeyPolicy()))
    home = key_partition(key, 3)
    others = [p for p in range(3) if p != home]
    for worker, owned, waiting in (("busy", [home], 40), ("idle", others, 0)):
        beat = WorkerHeartbeat(
            worker_id=worker,
            model=MODEL,
            partitions=[PartitionRef(topic=topic, partition=p) for p in owned],
            running=4,
            waiting=waiting,
            free_kv_blocks=50,
            total_kv_blocks=100,
            prefix_cache_hit_rate=0.5,
        )
        await redis.hset(names.workers_key(MODEL), worker, beat.model_dump_json())
    async with httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as http:
        response = await http.post("/v1/requests", json={"model": MODEL, "prompt": "divert me"})
        assert response.status_code == 202, response.text
    async with reader(settings, topic, partitions=3) as consumer:
        (record,) = await consume(consumer, 1)
    assert record.partition in others and record.key == key


async def test_status_is_per_tenant_and_delete_cancels(ingress: str, settings: Settings, redis: Redis) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    owner = httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY})
    other = httpx.AsyncClient(base_url=ingress, headers={"x-api-key": CAPPED_KEY})
    async with owner, other, reader(settings, names.control_topic, partitions=1) as control:
        rid = (await owner.post("/v1/requests", json={"model": MODEL, "prompt": "p"})).json()["request_id"]
        status = await owner.get(f"/v1/requests/{rid}")
        assert status.status_code == 200 and status.json()["status"] == "queued"
        assert status.json()["result"] is None
        assert (await other.get(f"/v1/requests/{rid}")).status_code == 404
        assert (await other.delete(f"/v1/requests/{rid}")).status_code == 404
        assert (await owner.get("/v1/requests/no-such-request")).json()["error"]["code"] == "request_not_found"

        response = await owner.delete(f"/v1/requests/{rid}")
        assert response.status_code == 202 and response.json() == {"request_id": rid, "status": "cancelling"}
        assert await redis.get(names.cancel_key(rid)) == b"client_cancelled"
        (message,) = await consume(control, 1)
    cancel = CancelRequest.model_validate_json(message.value)
    assert (cancel.request_id, cancel.reason) == (rid, "client_cancelled")
    assert message.key == rid.encode()

    # Once a worker records the result, GET returns it and DELETE has nothing left to cancel.
    record = RequestRecord.model_validate_json(await redis.get(names.request_key(rid)))
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    result = FinalResult(
        request_id=rid,
        model=MODEL,
        tenant=record.tenant,
        text="done!",
        token_ids=[4, 5],
        finish_reason="stop",
        usage=usage,
        worker_id="w1",
        created_at=record.created_at,
    )
    finished = record.model_copy(update={"status": "finished", "worker_id": "w1", "result": result})
    await redis.set(names.request_key(rid), finished.model_dump_json())
    async with httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as owner:
        status = (await owner.get(f"/v1/requests/{rid}")).json()
        assert status["status"] == "finished" and status["result"]["text"] == "done!"
        assert status["result"]["usage"]["total_tokens"] == 3
        assert (await owner.delete(f"/v1/requests/{rid}")).json()["error"]["code"] == "request_finished"


async def test_unknown_model_is_404_unless_configured(ingress: str, settings: Settings, redis: Redis) -> None:
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    # A stale heartbeat (older than three intervals) is not a live worker either.
    await heartbeat(redis, Names(settings.topic_prefix), "ghost", age_s=10)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="ghost", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key="wrong", max_retries=0).models.list()
    await client.close()

    served = settings.model_copy(update={"served_models": "ghost,other"})
    async with running_ingress(served) as url, httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}) as http:
        response = await http.post("/v1/requests", json={"model": "ghost", "prompt": "queued for later"})
        assert response.status_code == 202, response.text


async def test_models_list_follows_heartbeats(ingress: str, settings: Settings, redis: Redis) -> None:
    names = Names(settings.topic_prefix)
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    assert [m.id async for m in client.models.list()] == []
    await heartbeat(redis, names, "alpha")
    await heartbeat(redis, names, "beta", worker="w1")
    await heartbeat(redis, names, "beta", worker="w2")
    await heartbeat(redis, names, "stale", age_s=10)
    models = [m async for m in client.models.list()]
    assert sorted(m.id for m in models) == ["alpha", "beta"]
    assert {m.object for m in models} == {"model"}
    assert (await client.models.retrieve("beta")).id == "beta"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("stale")
    await client.close()


async def test_kafka_down_is_a_quick_503(settings: Settings, redis: Redis) -> None:
    down = settings.model_copy(
        update={"kafka_bootstrap": "127.0.0.1:1", "kafka_timeout_s": 2.0, "served_models": MODEL}
    )
    async with running_ingress(down) as url, httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}) as http:
        started = time.monotonic()
        response = await http.post("/v1/requests", json={"model": MODEL, "prompt": "p"})
        elapsed = time.monotonic() - started
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "service_unavailable" and "Kafka" in response.json()["error"]["message"]
    assert elapsed < 4.0
    assert [k async for k in redis.scan_iter(match=f"{settings.topic_prefix}llm:request:*")] == []


# --- OpenAI-compatible round trips ---------------------------------------------------------------------------
async def test_openai_client_chat_and_completions(ingress: str, settings: Settings, redis: Redis) -> None:
    await heartbeat(redis, Names(settings.topic_prefix))
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "hello there kafka"}]
    async with FakeWorker(settings, redis) as worker:
        chat = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0)  # type: ignore[arg-type]
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.content == "You said: hello there kafka"
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage is not None and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (7, 5)
        assert chat.usage.prompt_tokens_details is not None and chat.usage.prompt_tokens_details.cached_tokens == 2

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "You said: hello there kafka"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 12
        assert all(c.id == chunks[0].id for c in chunks) and chunks[0].id.startswith("chatcmpl-")

        completion = await client.completions.create(model=MODEL, prompt="one two three four", max_tokens=3)
        assert completion.choices[0].text == "You said: one"
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == 3

        pieces = []
        async for chunk in await client.completions.create(model=MODEL, prompt="streamed words", stream=True):
            pieces.append(chunk)
        assert "".join(c.choices[0].text for c in pieces) == "You said: streamed words"
        assert pieces[-1].choices[0].finish_reason == "stop"
        assert len(worker.seen) == 4
        # Non-streaming completions default to OpenAI's 16 tokens; the tier is the key's default.
        assert {r.priority for _, r in worker.seen} == {"standard"}
    await client.close()


async def test_restart_is_relayed_without_duplicates(ingress: str, settings: Settings, redis: Redis) -> None:
    await heartbeat(redis, Names(settings.topic_prefix))
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    async with FakeWorker(settings, redis, mode="restart"):
        whole = await client.completions.create(model=MODEL, prompt="again and again", max_tokens=50)
        assert whole.choices[0].text == "You said: again and again"
        text = ""
        async for chunk in await client.completions.create(model=MODEL, prompt="again and again", stream=True):
            text += chunk.choices[0].text
        assert text == "You said: again and again"
    await client.close()


async def test_client_disconnect_mid_stream_cancels(ingress: str, settings: Settings, redis: Redis) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "stream": True}
    async with (
        FakeWorker(settings, redis, mode="hang") as worker,
        reader(settings, names.control_topic, partitions=1) as control,
    ):
        async with (
            httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            rid = response.headers["x-request-id"]
            lines = response.aiter_lines()
            seen_text = False
            while not seen_text:
                line = await anext(lines)
                seen_text = '"content":"You"' in line
        # The connection is closed now, with the worker still generating.
        await eventually(lambda: redis.exists(names.cancel_key(rid)))
        assert await redis.get(names.cancel_key(rid)) == b"client_disconnected"
        (message,) = await consume(control, 1)
        assert CancelRequest.model_validate_json(message.value).reason == "client_disconnected"
        assert [r.request_id for _, r in worker.seen] == [rid]

        # Without streaming too: a client that gives up waiting cancels its request.
        async with httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json=body | {"stream": False}, timeout=1.5)
        assert len(worker.seen) == 2
        second = worker.seen[1][1].request_id
        await eventually(lambda: redis.exists(names.cancel_key(second)))
        assert await redis.get(names.cancel_key(second)) == b"client_disconnected"


# --- router stream processor -----------------------------------------------------------------------------------
async def test_router_routes_valid_and_dead_letters_invalid(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    stop = asyncio.Event()
    task = asyncio.create_task(run_router(settings, stop=stop))
    valid = InferenceRequest(request_id="ok-1", model=MODEL, prompt="route me", priority="batch")
    producer = create_producer(settings)
    await producer.start()
    try:
        traceparent = b"00-" + b"c" * 32 + b"-" + b"d" * 16 + b"-01"
        await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: 3}, 1)
        bad_tier = json.dumps({"request_id": "bad-1", "model": MODEL, "prompt": "x", "priority": "urgent"})
        expired = valid.model_copy(update={"request_id": "late-1", "deadline": utcnow() - timedelta(seconds=1)})
        unknown = valid.model_copy(update={"request_id": "who-1", "model": "nobody-serves-this"})
        inbound = (
            valid.model_dump_json(),
            "{{not json",
            bad_tier,
            expired.model_dump_json(),
            unknown.model_dump_json(),
        )
        for value in inbound:
            await producer.send_and_wait(
                names.inbound_topic, value.encode(), key=b"k", headers=[("traceparent", traceparent)]
            )
        async with (
            reader(settings, names.request_topic(MODEL, "batch"), partitions=3) as routed_reader,
            reader(settings, names.dlq_topic, partitions=3) as dlq_reader,
        ):
            (routed,) = await consume(routed_reader, 1, timeout_s=30)
            letters = await consume(dlq_reader, 4, timeout_s=30)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 15)

    assert InferenceRequest.model_validate_json(routed.value).request_id == "ok-1"
    assert routed.key == partition_key(MODEL, affinity_prefix(valid, KeyPolicy()))
    assert dict(routed.headers) == {"request_id": b"ok-1", "traceparent": traceparent}
    reasons = {dict(r.headers)["reason"].decode(): DeadLetter.model_validate_json(r.value) for r in letters}
    assert set(reasons) == {"invalid_json", "schema_violation:priority", "deadline_exceeded", "unknown_model"}
    assert reasons["schema_violation:priority"].request_id == "bad-1"
    assert "'priority'" in reasons["schema_violation:priority"].detail
    assert reasons["invalid_json"].payload == "{{not json"
    assert reasons["deadline_exceeded"].request_id == "late-1"
    assert reasons["unknown_model"].request_id == "who-1"
    # Offsets were committed only after delivery: a second router in the group has nothing left to do.
    admin = create_admin(settings)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(f"{names.prefix}{settings.router_group}")
    finally:
        await admin.close()
    assert sum(max(0, meta.offset) for meta in offsets.values()) == 5
