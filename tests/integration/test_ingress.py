"""Ingress and the router stream processor on a real Kafka broker and Redis server.

A small fake worker (a real aiokafka consumer that answers requests by appending real stream events to
Redis, as the GPU worker does) stands in for the engine, so the official ``openai`` client is exercised
end to end: publish, route, tail, convert.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiokafka.conn import AIOKafkaConnection
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError
from ingress_support import (
    CAPPED_KEY,
    KEY,
    MODEL,
    FakeWorker,
    consume,
    consume_cancels,
    eventually,
    heartbeat,
    reader,
    running_ingress,
)
from private_redis import private_redis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection as RedisConnection

from ingress.auth import hash_key
from ingress.producer_pool import ProducerPool
from ingress.service import IngressService
from ingress.telemetry import IngressMetrics
from router import KeyPolicy
from router.policy import affinity_prefix, key_partition, partition_key
from router.stream import run_router
from schemas import (
    STREAM_FIELD,
    CancelRequest,
    DeadLetter,
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
from sluicegate.api.errors import ApiError
from sluicegate.kafka import create_admin, create_producer, ensure_topics
from sluicegate.settings import Settings
from sluicegate.stream_tokens import verify_stream_token
from sluicegate.usage.quota import QuotaClaim, QuotaLimit, Quotas

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

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
            # One heartbeat written at a test's start stays live for three intervals: a slow test on a loaded
            # machine (a router joining its group, topics created) must not outlive it (a 1 s interval did).
            "heartbeat_interval_s": 30.0,
            "kafka_timeout_s": 5.0,
            "request_timeout_s": 30.0,
            "public_stream_url": "ws://results.example:8001",
        }
    )


@pytest.fixture
async def ingress(settings: Settings, cleanup_topics: None) -> AsyncIterator[str]:
    async with running_ingress(settings) as url:
        yield url


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
    # Valid for the request's longest life plus the stream's retention, from the submit.
    expires_at = int(submitted["stream_token"].split(".")[-2])
    assert abs(expires_at - (time.time() + settings.stream_token_lifetime_s)) < 60

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


async def test_the_produce_request_leaves_before_the_status_record(
    settings: Settings, redis: Redis, cleanup_topics: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first token waits for the produce request, not for the status record: the record's write goes out
    # right behind it (still before the acknowledgement). Both writes are stamped as they reach their sockets.
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    writes: list[str] = []
    kafka_send = AIOKafkaConnection.send
    redis_send = RedisConnection.send_packed_command

    def stamped_kafka(self: AIOKafkaConnection, request: Any, *args: Any, **kwargs: Any) -> Any:
        if type(request).__name__.startswith("ProduceRequest"):
            writes.append("produce")
        return kafka_send(self, request, *args, **kwargs)

    async def stamped_redis(self: RedisConnection, command: Any, *args: Any, **kwargs: Any) -> None:
        packed = b"".join(command) if isinstance(command, list) else command
        if names.request_key("").encode() in packed:
            writes.append("record")
        await redis_send(self, command, *args, **kwargs)

    service = IngressService(settings, IngressMetrics())
    try:
        heartbeats = await service.model_heartbeats(MODEL)
        for n in range(3):  # the first publish also creates the topics and fetches metadata
            request = InferenceRequest(
                request_id=f"order-{n}", model=MODEL, prompt="which goes first?", tenant="t", created_at=utcnow()
            )
            if n == 2:
                writes.clear()
                monkeypatch.setattr(AIOKafkaConnection, "send", stamped_kafka)
                monkeypatch.setattr(RedisConnection, "send_packed_command", stamped_redis)
            route = await service.route(request, max_tier="interactive", heartbeats=heartbeats)
            await service.publish(request, route, {})
    finally:
        monkeypatch.undo()
        await service.close()
    assert writes == ["produce", "record"]
    stored = RequestRecord.model_validate_json(await redis.get(names.request_key("order-2")))
    assert stored.status == "queued"


async def test_a_publish_kafka_does_not_acknowledge_leaves_no_record_and_no_quota_reservation(
    settings: Settings, redis: Redis, cleanup_topics: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Recording and publishing are one step: the status record goes out while the broker acknowledges, and a
    # delivery that fails takes it back (leaving the cancel marker) and gives back the quota admission reserved,
    # so a request its client hears 503 for leaves nothing that says it was queued.
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    written = asyncio.Event()
    save_record = IngressService._save_record

    async def noted_save(self: IngressService, record: RequestRecord) -> None:
        await save_record(self, record)
        written.set()

    async def unacknowledged(*_: Any) -> asyncio.Task[None]:
        async def delivery() -> None:
            await written.wait()  # the record is in Redis by now
            raise KafkaTimeoutError()

        return asyncio.create_task(delivery())

    service = IngressService(settings, IngressMetrics())
    quotas = Quotas(redis, names)
    day = QuotaLimit("tenant", "t", "day", 1000)
    try:
        heartbeats = await service.model_heartbeats(MODEL)
        request = InferenceRequest(request_id="lost", model=MODEL, prompt="never acknowledged", tenant="t")
        route = await service.route(request, max_tier="interactive", heartbeats=heartbeats)
        assert await quotas.reserve(QuotaClaim("lost", 50, (day,))) is None  # what admission reserved for it
        monkeypatch.setattr(IngressService, "_save_record", noted_save)
        monkeypatch.setattr("ingress.service.send_routed", unacknowledged)
        with pytest.raises(ApiError) as refused:
            await service.publish(request, route, {})
    finally:
        monkeypatch.undo()
        await service.close()
    assert written.is_set()
    assert refused.value.status == 503 and refused.value.headers is not None
    assert refused.value.headers["x-request-id"] == "lost"
    assert await redis.get(names.request_key("lost")) is None
    assert await redis.exists(names.cancel_key("lost"))
    assert await quotas.used(day) == 0 and not await redis.exists(names.quota_hold_key("lost"))


async def test_concurrent_publishes_go_through_different_producers(settings: Settings, cleanup_topics: None) -> None:
    # aiokafka keeps one produce request in flight per producer: a second publish on a busy producer would wait
    # for the first one's acknowledgement, so the pool hands it the idle one.
    pool = ProducerPool(settings.model_copy(update={"ingress_producers": 2}))
    with pytest.raises(KafkaConnectionError):
        with pool.lease():
            pass
    await pool.start()
    try:
        with pool.lease() as first:
            with pool.lease() as second:
                assert second is not first
                with pool.lease() as third:  # both busy: either will do
                    assert third in (first, second)
            with pool.lease() as again:
                assert again is second  # the one not in use
        topic = settings.topic_prefix + "pool-check"
        await ensure_topics(settings.kafka_bootstrap, {topic: 1}, settings.topic_replication)
        metadata = await (await first.send(topic, b"x"))
        assert (metadata.topic, metadata.offset) == (topic, 0)
    finally:
        await pool.close()
    assert not pool.started


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


async def test_a_record_redis_refuses_turns_the_published_request_into_a_cancelled_503(
    settings: Settings, cleanup_topics: None, tmp_path: Path
) -> None:
    # The status record and the publish go out together; when Redis refuses the record (here: it refuses every
    # write, as it does when it lacks the replicas it was told to write to), the client hears 503 and the
    # request, already in Kafka, is taken back over the control topic so no worker starts it. A Redis of this
    # test's own: told to refuse writes, the session's shared one would refuse every other test's too (a worker
    # beside it died on its heartbeat).
    names = Names(settings.topic_prefix)
    topic = names.request_topic(MODEL, "standard")
    with private_redis(tmp_path) as server:
        own = settings.model_copy(update={"redis_url": server.url})
        redis = Redis.from_url(server.url)
        await heartbeat(redis, names)
        async with (
            running_ingress(own) as ingress,
            httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as http,
            reader(settings, names.control_topic, partitions=1) as control,
            reader(settings, topic, partitions=3) as requests,
        ):
            await redis.config_set("min-replicas-to-write", 1)
            try:
                response = await http.post("/v1/requests", json={"model": MODEL, "prompt": "refused record"})
            finally:
                await redis.config_set("min-replicas-to-write", 0)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["message"].startswith("Redis is unavailable: ")
            rid = response.headers["x-request-id"]
            (published,) = await consume(requests, 1)
            (message,) = await consume_cancels(control, 1)
        assert InferenceRequest.model_validate_json(published.value).request_id == rid
        cancel = CancelRequest.model_validate_json(message.value)
        assert (cancel.request_id, cancel.reason) == (rid, "record_failed")
        assert await redis.get(names.request_key(rid)) is None
        await redis.aclose()


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
        assert CancelRequest.model_validate_json(await redis.get(names.cancel_key(rid))).reason == "client_cancelled"
        (message,) = await consume_cancels(control, 1)
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
        # A cancelled one too: a second DELETE is a 409, not another "cancelling".
        await redis.set(names.request_key(rid), record.model_copy(update={"status": "cancelled"}).model_dump_json())
        again = await owner.delete(f"/v1/requests/{rid}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "request_finished", again.text
        assert "already cancelled" in again.json()["error"]["message"]


async def test_unknown_model_is_404_unless_configured(ingress: str, settings: Settings, redis: Redis) -> None:
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    # A stale heartbeat (older than three intervals) is not a live worker either.
    await heartbeat(redis, Names(settings.topic_prefix), "ghost", age_s=600)
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
    await heartbeat(redis, names, "beta", worker="w2", description="random weights")
    await heartbeat(redis, names, "stale", age_s=600)
    models = [m async for m in client.models.list()]
    assert sorted(m.id for m in models) == ["alpha", "beta"]
    assert {m.object for m in models} == {"model"}
    # What a worker says of its model (sluicegate up's random fallback) reaches the SDK as an extra field.
    assert {m.id: getattr(m, "description", None) for m in models} == {"alpha": None, "beta": "random weights"}
    assert getattr(await client.models.retrieve("beta"), "description", None) == "random weights"
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
        # A refused request still has an id the SDK shows (a user quotes it; the log line names it).
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=messages, temperature=9)  # type: ignore[arg-type]
        assert refused.value.request_id and len(refused.value.request_id) == 32
    await client.close()


async def test_a_request_the_worker_fails_is_answered_under_its_own_request_id(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    await heartbeat(redis, Names(settings.topic_prefix))
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    async with FakeWorker(settings, redis, mode="fail") as worker:
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(model=MODEL, prompt="break", max_tokens=3)
    ((_, request),) = worker.seen
    assert failed.value.request_id == request.request_id  # the id its stream, trace and usage record carry
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
        assert CancelRequest.model_validate_json(await redis.get(names.cancel_key(rid))).reason == "client_disconnected"
        (message,) = await consume_cancels(control, 1)
        assert CancelRequest.model_validate_json(message.value).reason == "client_disconnected"
        assert [r.request_id for _, r in worker.seen] == [rid]

        # Without streaming too: a client that gives up waiting cancels its request.
        async with httpx.AsyncClient(base_url=ingress, headers={"x-api-key": KEY}) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json=body | {"stream": False}, timeout=1.5)
        assert len(worker.seen) == 2
        second = worker.seen[1][1].request_id
        await eventually(lambda: redis.exists(names.cancel_key(second)))
        marker = await redis.get(names.cancel_key(second))
        assert CancelRequest.model_validate_json(marker).reason == "client_disconnected"


async def test_openai_requests_name_the_ingress_reader_lease_which_ends_with_the_ingress(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    # Only ingress relays an OpenAI-style response, and its client cannot resume it: the request names this
    # instance's lease (workers stop it once the lease lapses). A native request's client resumes from the stream.
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "stream": True}
    async with FakeWorker(settings, redis, mode="hang") as worker:
        async with (
            running_ingress(settings) as url,
            httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}) as http,
        ):
            native = await http.post("/v1/requests", json={"model": MODEL, "prompt": "resumable"})
            assert native.status_code == 202, native.text
            async with http.stream("POST", "/v1/chat/completions", json=chat) as response:
                assert response.status_code == 200
                relayed = response.headers["x-request-id"]

                async def both_seen() -> bool:
                    return len(worker.seen) == 2

                await eventually(both_seen)
                readers = {request.request_id: request.reader for _, request in worker.seen}
                assert readers[native.json()["request_id"]] is None
                lease = readers[relayed]
                assert lease is not None
                assert 0 < await redis.pttl(names.reader_key(lease)) <= settings.reader_lease_s * 1000
        # The ingress stopped: it gave its lease up, so its requests' workers stop them.
        assert not await redis.exists(names.reader_key(lease))


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
        # A refused record under the id of a request whose stream already exists must leave that stream alone.
        running = TokenEvent(request_id="taken-1", seq=0, text="Hi", token_ids=[1])
        await redis.xadd(names.stream_key("taken-1"), {STREAM_FIELD: running.model_dump_json()}, id="0-1")
        taken = unknown.model_copy(update={"request_id": "taken-1"})
        inbound = (
            valid.model_dump_json(),
            "{{not json",
            bad_tier,
            expired.model_dump_json(),
            unknown.model_dump_json(),
            taken.model_dump_json(),
        )
        for value in inbound:
            await producer.send_and_wait(
                names.inbound_topic, value.encode(), key=b"k", headers=[("traceparent", traceparent)]
            )
        # A malformed traceparent is not passed on (nor its tracestate).
        garbled = valid.model_copy(update={"request_id": "ok-2"}).model_dump_json().encode()
        trace_headers = [("traceparent", b"garbage"), ("tracestate", b"k=v")]
        await producer.send_and_wait(names.inbound_topic, garbled, key=b"k", headers=trace_headers)
        async with (
            reader(settings, names.request_topic(MODEL, "batch"), partitions=3) as routed_reader,
            reader(settings, names.dlq_topic, partitions=3) as dlq_reader,
        ):
            routed_records = await consume(routed_reader, 2, timeout_s=30)
            letters = await consume(dlq_reader, 5, timeout_s=30)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 15)

    by_id = {InferenceRequest.model_validate_json(r.value).request_id: r for r in routed_records}
    routed = by_id["ok-1"]
    assert routed.key == partition_key(MODEL, affinity_prefix(valid, KeyPolicy()))
    assert dict(routed.headers) == {"request_id": b"ok-1", "traceparent": traceparent}
    assert dict(by_id["ok-2"].headers) == {"request_id": b"ok-2"}
    reasons = {
        dict(r.headers)["reason"].decode(): DeadLetter.model_validate_json(r.value)
        for r in letters
        if dict(r.headers).get("request_id") != b"taken-1"
    }
    assert set(reasons) == {"invalid_json", "schema_violation:priority", "deadline_exceeded", "unknown_model"}
    # A client that only reads the stream hears why its record was refused.
    for rid, code in (("bad-1", "schema_violation"), ("late-1", "deadline_exceeded"), ("who-1", "unknown_model")):
        entries = await redis.xrange(names.stream_key(rid))
        assert len(entries) == 1, (rid, entries)
        event = ErrorEvent.model_validate_json(entries[0][1][STREAM_FIELD.encode()])
        assert (event.seq, event.code) == (0, code), event
        assert 0 < await redis.ttl(names.stream_key(rid)) <= settings.stream_ttl_s
    assert (
        "'priority'"
        in ErrorEvent.model_validate_json(
            (await redis.xrange(names.stream_key("bad-1")))[0][1][STREAM_FIELD.encode()]
        ).message
    )
    assert len(await redis.xrange(names.stream_key("taken-1"))) == 1  # still only the running request's token
    assert await redis.ttl(names.stream_key("taken-1")) == -1
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
    assert sum(max(0, meta.offset) for meta in offsets.values()) == 7


async def test_records_too_large_to_route_or_to_quote_are_dead_lettered_and_the_router_goes_on(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    """Two records the broker took whole but that could not go on as they were, each once held its partition
    (the batch retried forever, re-routing the records batched with it): a 2.2 MB record of quotes, whose letter
    quoted it at twice its size, and a valid request near the 4 MiB limit whose routed copy (every default
    written out) was a few hundred bytes over. Both are dead-lettered, cut to fit, and the next record is routed
    once."""
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    stop = asyncio.Event()
    task = asyncio.create_task(run_router(settings, stop=stop))
    near = {"request_id": "big-1", "model": MODEL, "sampling": {"max_tokens": 4}, "prompt": ""}
    near["prompt"] = "a" * (4_194_000 - len(json.dumps(near, separators=(",", ":"))))
    after = InferenceRequest(request_id="after-1", model=MODEL, prompt="route me", priority="batch")
    producer = create_producer(settings)
    await producer.start()
    try:
        await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: 3}, 1)
        inbound = (b'"' * 2_200_000, json.dumps(near, separators=(",", ":")).encode(), after.model_dump_json().encode())
        for value in inbound:
            await producer.send_and_wait(names.inbound_topic, value, key=b"k")
        async with (
            reader(settings, names.request_topic(MODEL, "batch"), partitions=3) as routed_reader,
            reader(settings, names.dlq_topic, partitions=3) as dlq_reader,
        ):
            letters = await consume(dlq_reader, 2, timeout_s=30)
            routed = await consume(routed_reader, 1, timeout_s=30)
            await asyncio.sleep(2.5)  # a retried batch would route it again after the router's 1 s backoff
            again = await routed_reader.getmany(timeout_ms=1000)
            assert not any(again.values()), again
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 15)
    assert [InferenceRequest.model_validate_json(r.value).request_id for r in routed] == ["after-1"]
    reasons = {dict(r.headers)["reason"].decode(): DeadLetter.model_validate_json(r.value) for r in letters}
    assert set(reasons) == {"invalid_json", "record_too_large"}
    assert reasons["record_too_large"].request_id == "big-1"
    assert all(letter.payload_truncated for letter in reasons.values())
