"""Admission by deadline on a real Kafka broker and Redis server: a request whose deadline the backlog its model's
workers report (``backlog_seconds`` in their heartbeats) cannot meet is refused at once with OpenAI's 429 shape and
code ``deadline_unmeetable`` (an SDK does not retry it) and nothing is queued; the router dead-letters a Kafka-native
record with that reason; requests whose deadline is far enough, or whose tier has no backlog, go through.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
from ingress_support import KEY, MODEL, consume, heartbeat, reader, running_ingress
from redis.asyncio import Redis

from router.stream import run_router
from schemas import DeadLetter, InferenceRequest, Names, utcnow
from sluicegate.kafka import create_producer, ensure_topics
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# What a loaded worker reports: nothing ahead at interactive, two minutes at standard, five at batch.
BACKLOG = {"interactive": 0.0, "standard": 120.0, "batch": 300.0}


@pytest.fixture
def settings(test_settings: Settings, tmp_path: Path) -> Settings:
    return test_settings.model_copy(
        update={
            "api_keys": KEY,
            "stream_token_secret": "deadline-secret",
            "topic_partitions": 3,
            # One heartbeat written at a test's start stays live for three intervals: a slow test on a loaded
            # machine (a router joining its group, topics created) must not outlive it (a 1 s interval did).
            "heartbeat_interval_s": 30.0,
            "kafka_timeout_s": 5.0,
            "served_models": MODEL,
        }
    )


async def test_an_unmeetable_deadline_is_refused_at_once_and_nothing_is_queued(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names, backlog_seconds=BACKLOG)
    # A second worker, more loaded: the least loaded one's figure decides.
    await heartbeat(redis, names, worker="w2", backlog_seconds={"standard": 900.0})
    async with running_ingress(settings) as url:
        sent: list[httpx.Request] = []

        async def count(request: httpx.Request) -> None:
            sent.append(request)

        # The SDK's default retries stay on; every request it sends is counted.
        http_client = httpx.AsyncClient(event_hooks={"request": [count]})
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=http_client)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.RateLimitError) as header_refusal:
            await sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, extra_headers={"X-Request-Deadline": "5"}
            )
        with pytest.raises(openai.RateLimitError) as body_refusal:
            await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"deadline": 30})
        # Refused at once, and not retried by the SDK (x-should-retry: false): one request each.
        assert len(sent) == 2, [r.url for r in sent]
        for refusal in (header_refusal.value, body_refusal.value):
            assert refusal.status_code == 429
            assert refusal.code == "deadline_unmeetable" and refusal.type == "rate_limit_error"
            assert "120.0 s of work queued at or above the 'standard' tier" in refusal.message
        await sdk.close()

        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            absolute = (utcnow() + timedelta(seconds=10)).isoformat()
            late = await http.post("/v1/requests", json={"model": MODEL, "prompt": "x", "deadline": absolute})
            assert late.status_code == 429 and late.json()["error"]["code"] == "deadline_unmeetable"
            assert late.headers["x-should-retry"] == "false"
            # Time enough, a tier with nothing ahead, or no deadline at all: admitted.
            roomy = await http.post("/v1/requests", json={"model": MODEL, "prompt": "x", "deadline": 600})
            urgent = await http.post(
                "/v1/requests",
                json={"model": MODEL, "prompt": "x", "priority": "interactive"},
                headers={"X-Request-Deadline": "5"},
            )
            plain = await http.post("/v1/requests", json={"model": MODEL, "prompt": "x"})
            bad = await http.post(
                "/v1/requests", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Deadline": "soon"}
            )
            past = await http.post(
                "/v1/requests",
                json={"model": MODEL, "prompt": "x"},
                headers={"X-Request-Deadline": "2020-01-01T00:00:00Z"},
            )
            # One microsecond: passed by the time it would be queued. The worker's answer for a passed deadline,
            # at once, and not retried by the SDKs.
            gone = await http.post("/v1/requests", json={"model": MODEL, "prompt": "x", "deadline": 1e-6})
        accepted = [r.json()["request_id"] for r in (roomy, urgent, plain)]
        assert [r.status_code for r in (roomy, urgent, plain)] == [202, 202, 202]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Deadline"
        assert past.status_code == 400 and past.json()["error"]["param"] == "X-Request-Deadline", past.text
        assert "has already passed" in past.json()["error"]["message"]
        assert gone.status_code == 504 and gone.json()["error"]["code"] == "deadline_exceeded", gone.text
        assert gone.headers["x-should-retry"] == "false"

    async with reader(settings, *names.request_topics(MODEL), partitions=settings.topic_partitions) as consumer:
        records = await consume(consumer, len(accepted))
        records += [r for batch in (await consumer.getmany(timeout_ms=500)).values() for r in batch]
    # Only what was admitted reached Kafka, deadlines as given.
    queued = {r.request_id: r for r in (InferenceRequest.model_validate_json(x.value) for x in records)}
    assert sorted(queued) == sorted(accepted)
    assert queued[accepted[1]].deadline is not None and queued[accepted[2]].deadline is None


async def test_the_router_dead_letters_a_kafka_native_record_whose_deadline_cannot_be_met(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names, backlog_seconds=BACKLOG)
    stop = asyncio.Event()
    task = asyncio.create_task(run_router(settings, stop=stop))
    soon = utcnow() + timedelta(seconds=20)
    unmeetable = InferenceRequest(request_id="soon-1", model=MODEL, prompt="x", priority="standard", deadline=soon)
    meetable = unmeetable.model_copy(update={"request_id": "later-1", "deadline": utcnow() + timedelta(minutes=10)})
    producer = create_producer(settings)
    await producer.start()
    try:
        await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: 3}, 1)
        for request in (unmeetable, meetable):
            await producer.send_and_wait(names.inbound_topic, request.model_dump_json().encode(), key=b"k")
        async with (
            reader(settings, names.request_topic(MODEL, "standard"), partitions=3) as routed_reader,
            reader(settings, names.dlq_topic, partitions=3) as dlq_reader,
        ):
            (routed,) = await consume(routed_reader, 1, timeout_s=30)
            (letter,) = await consume(dlq_reader, 1, timeout_s=30)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 15)
    assert InferenceRequest.model_validate_json(routed.value).request_id == "later-1"
    assert dict(letter.headers)["reason"] == b"deadline_unmeetable"
    dead = DeadLetter.model_validate_json(letter.value)
    assert dead.request_id == "soon-1" and "120.0 s of work queued" in dead.detail
