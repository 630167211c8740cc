"""The multiplexed stream socket (``/v1/streams``) against a real Redis (and Kafka for cancels): many streams on one
socket, each with the single-stream socket's guarantees, and bad input answered without harming the others."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from redis.asyncio import Redis
from relay_support import (
    SECRET,
    TENANT,
    Running,
    append,
    done_event,
    expected_token,
    open_unread_websocket,
    overflow_until_dropped,
    read_stream,
    running_relay,
    token_events,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from result_service.hub import RelayConfig
from schemas import CancelRequest, DoneEvent, Names, RequestRecord, stream_entry_id, utcnow
from sluicegate.settings import Settings
from sluicegate.stream_tokens import issue_stream_token

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def settings(redis_url: str, kafka_bootstrap: str, unique_prefix: str) -> Settings:
    return Settings(
        redis_url=redis_url, kafka_bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, stream_token_secret=SECRET
    )


@pytest.fixture
def names(settings: Settings) -> Names:
    return Names(settings.topic_prefix)


@pytest.fixture
async def service(settings: Settings) -> AsyncIterator[Running]:
    async with running_relay(settings, RelayConfig(client_name=f"mux-test-{uuid.uuid4().hex[:8]}")) as relay:
        yield relay


def rid() -> str:
    return f"req-{uuid.uuid4().hex[:8]}"


def subscribe(request_id: str, **extra: Any) -> str:
    token = extra.pop("token", None) or issue_stream_token(SECRET, request_id, TENANT, lifetime_s=3600)
    return json.dumps({"type": "subscribe", "request_id": request_id, "token": token, **extra})


async def read_until(ws: ClientConnection, ended: set[str]) -> list[dict[str, Any]]:
    """Messages until every request in ``ended`` saw its ``done``, ``error`` or ``closed``."""
    messages: list[dict[str, Any]] = []
    waiting = set(ended)
    while waiting:
        message = json.loads(await asyncio.wait_for(ws.recv(), 10))
        messages.append(message)
        if message["type"] in ("done", "error", "closed"):
            waiting.discard(message["request_id"])
    return messages


def by_stream(messages: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    streams: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for message in messages:
        streams[message["request_id"]].append(message)
    return streams


async def test_two_streams_share_one_socket_each_in_order_with_the_single_sockets_json(
    service: Running, redis: Redis, names: Names
) -> None:
    a, b, c = rid(), rid(), rid()
    await append(redis, names, token_events(a, 0, 3))  # history for one, nothing yet for the other
    async with connect(f"{service.ws_url}/v1/streams") as ws:
        await ws.send(subscribe(a))
        await ws.send(subscribe(b))
        assert [json.loads(await ws.recv())["seq"] for _ in range(3)] == [0, 1, 2]
        for seq in range(3, 12):  # live tails, interleaved
            await append(redis, names, [*token_events(a, seq, 1), *token_events(b, seq - 3, 1)])
        await append(redis, names, [done_event(a, 12), done_event(b, 9)])
        streams = by_stream(await read_until(ws, {a, b}))
        assert streams[a] == [*(expected_token(a, s) for s in range(3, 12)), streams[a][-1]]
        assert streams[a][-1]["type"] == "done" and streams[a][-1]["id"] == stream_entry_id(12)
        assert [e["seq"] for e in streams[b]] == list(range(10))
        # Exactly what the single-stream socket relays for the same stream.
        single = await read_stream(service.stream_url(b))
        assert single.events == streams[b]

        # The socket stays open for the next request.
        await ws.send(subscribe(c))
        await append(redis, names, [*token_events(c, 0, 2), done_event(c, 2)])
        assert [e["seq"] for e in await read_until(ws, {c})] == [0, 1, 2]


async def test_resume_points_and_ended_streams_answer_per_subscription(
    service: Running, redis: Redis, names: Names
) -> None:
    resumed, finished, expired = rid(), rid(), rid()
    await append(redis, names, [*token_events(resumed, 0, 5), done_event(resumed, 5)])
    await append(redis, names, [*token_events(finished, 0, 1), done_event(finished, 1)])
    record = RequestRecord(
        request_id=expired, model="m", tenant=TENANT, priority="interactive", status="finished", created_at=utcnow()
    )
    await redis.set(names.request_key(expired), record.model_dump_json())
    async with connect(f"{service.ws_url}/v1/streams") as ws:
        await ws.send(subscribe(resumed, last_id=stream_entry_id(2)))
        await ws.send(subscribe(finished, last_id=stream_entry_id(1)))
        await ws.send(subscribe(expired))
        streams = by_stream(await read_until(ws, {resumed, finished, expired}))
    assert [e["seq"] for e in streams[resumed]] == [3, 4, 5]
    assert streams[finished] == [
        {"type": "closed", "request_id": finished, "code": 1000, "reason": "stream already finished"}
    ]
    assert streams[expired][0]["code"] == 4404 and "expired" in streams[expired][0]["reason"]


async def test_a_resume_point_past_a_running_streams_end_is_closed_when_it_ends(
    service: Running, redis: Redis, names: Names
) -> None:
    running = rid()
    await append(redis, names, token_events(running, 0, 2))
    async with connect(f"{service.ws_url}/v1/streams") as ws:
        await ws.send(subscribe(running, last_id=stream_entry_id(5)))
        await asyncio.sleep(0.2)
        await append(redis, names, [done_event(running, 2)])
        messages = await read_until(ws, {running})
    assert messages == [{"type": "closed", "request_id": running, "code": 1000, "reason": "stream already finished"}]


async def test_bad_input_is_answered_and_the_other_streams_go_on(service: Running, redis: Redis, names: Names) -> None:
    good, refused = rid(), rid()
    async with connect(f"{service.ws_url}/v1/streams") as ws:
        await ws.send(subscribe(good))
        await ws.send("not json")
        invalid = json.loads(await ws.recv())
        assert invalid["type"] == "invalid" and "subscribe" in invalid["reason"]
        assert invalid["reason"].startswith("not a JSON message"), invalid  # no field named for a parse error
        await ws.send(json.dumps({"type": "subscribe", "request_id": "bad id!", "token": "x"}))
        assert "request_id" in json.loads(await ws.recv())["reason"]
        await ws.send(subscribe(refused, token=issue_stream_token("another-secret", refused, TENANT, lifetime_s=60)))
        closed = json.loads(await ws.recv())
        assert (closed["type"], closed["request_id"], closed["code"]) == ("closed", refused, 1008)
        assert "invalid stream token" in closed["reason"]
        await ws.send(subscribe(good, last_id="nonsense"))  # a second subscription to the same request
        assert "already subscribed" in json.loads(await ws.recv())["reason"]
        await ws.send(json.dumps({"type": "cancel", "request_id": refused}))  # never subscribed: no right to cancel
        assert "not subscribed" in json.loads(await ws.recv())["reason"]

        await append(redis, names, [*token_events(good, 0, 2), done_event(good, 2)])
        assert [e["seq"] for e in await read_until(ws, {good})] == [0, 1, 2]
    assert not await redis.exists(names.cancel_key(refused))


async def test_unsubscribe_stops_one_stream_and_a_later_subscription_resumes_it(
    service: Running, redis: Redis, names: Names
) -> None:
    request = rid()
    async with connect(f"{service.ws_url}/v1/streams") as ws:
        await ws.send(subscribe(request))
        await append(redis, names, token_events(request, 0, 2))
        got = [json.loads(await ws.recv()) for _ in range(2)]
        await ws.send(json.dumps({"type": "unsubscribe", "request_id": request}))
        closed = json.loads(await ws.recv())
        assert (closed["type"], closed["code"], closed["reason"]) == ("closed", 1000, "unsubscribed")
        await append(redis, names, token_events(request, 2, 2))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ws.recv(), 0.3)  # nothing more of it on this socket
        await ws.send(subscribe(request, last_id=got[-1]["id"]))
        await append(redis, names, [done_event(request, 4)])
        assert [e["seq"] for e in await read_until(ws, {request})] == [2, 3, 4]


async def test_a_socket_follows_at_most_its_limit_of_streams(settings: Settings, redis: Redis, names: Names) -> None:
    config = RelayConfig(mux_max_streams=2, client_name=f"mux-test-{uuid.uuid4().hex[:8]}")
    first, second, third = rid(), rid(), rid()
    async with running_relay(settings, config) as relay:
        async with connect(f"{relay.ws_url}/v1/streams") as ws:
            for request in (first, second, third):
                await ws.send(subscribe(request))
            closed = json.loads(await ws.recv())
            assert (closed["request_id"], closed["code"]) == (third, 1008) and "limit" in closed["reason"]
            await append(redis, names, [done_event(first, 0)])
            assert (await read_until(ws, {first}))[-1]["type"] == "done"
            await ws.send(subscribe(third))  # a place came free
            await append(redis, names, [done_event(second, 0), done_event(third, 0)])
            assert {m["request_id"] for m in await read_until(ws, {second, third})} == {second, third}


async def test_cancel_over_the_socket_reaches_the_control_topic(
    service: Running, settings: Settings, redis: Redis, names: Names
) -> None:
    request, other = rid(), rid()
    consumer = AIOKafkaConsumer(
        names.control_topic, bootstrap_servers=settings.kafka_bootstrap, auto_offset_reset="earliest", group_id=None
    )
    try:
        async with connect(f"{service.ws_url}/v1/streams") as ws:
            await ws.send(subscribe(request))
            await ws.send(subscribe(other))
            await append(redis, names, token_events(request, 0, 1))
            assert json.loads(await ws.recv())["seq"] == 0
            await ws.send(json.dumps({"type": "cancel", "request_id": request}))
            for _ in range(100):
                if await redis.exists(names.cancel_key(request)):
                    break
                await asyncio.sleep(0.05)
            marker = await redis.get(names.cancel_key(request))
            assert marker is not None and CancelRequest.model_validate_json(marker).request_id == request
            abort = DoneEvent.model_validate({**done_event(request, 1).model_dump(), "finish_reason": "abort"})
            await append(redis, names, [abort, done_event(other, 0)])
            streams = by_stream(await read_until(ws, {request, other}))
        assert streams[request][-1]["finish_reason"] == "abort"
        assert streams[other][-1]["finish_reason"] == "stop"  # the other request was not cancelled
        assert not await redis.exists(names.cancel_key(other))
        await consumer.start()
        batch = await consumer.getmany(timeout_ms=15_000)
        messages = [CancelRequest.model_validate_json(m.value) for records in batch.values() for m in records]
        assert [(m.request_id, m.tenant) for m in messages] == [(request, TENANT)]
    finally:
        await consumer.stop()


async def test_a_client_that_stops_reading_is_dropped_with_1013_and_resubscribes_losslessly(
    settings: Settings, redis: Redis, names: Names
) -> None:
    config = RelayConfig(max_pending=16, read_count=16, client_name=f"mux-test-{uuid.uuid4().hex[:8]}")
    request = rid()
    async with running_relay(settings, config) as relay:
        unread = await open_unread_websocket(f"{relay.ws_url}/v1/streams")
        unread[0].send_text(subscribe(request).encode())
        unread[2].write(b"".join(unread[0].data_to_send()))
        await asyncio.sleep(0.2)
        first = await overflow_until_dropped(redis, names, request, unread)
        seqs = [e["seq"] for e in first.events]

        await append(redis, names, [done_event(request, 300)])
        async with connect(f"{relay.ws_url}/v1/streams", max_size=2**20) as ws:
            await ws.send(subscribe(request, last_id=first.events[-1]["id"]))
            rest = await read_until(ws, {request})
        assert seqs + [e["seq"] for e in rest] == list(range(301))


async def gauges(service: Running) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{service.http_url}/metrics")).text
    wanted = ("sluicegate_relay_subscribers", "sluicegate_relay_mux_sockets")
    lines = text.splitlines()
    return {name: float(line.split()[-1]) for line in lines for name in wanted if line.startswith(name + " ")}


async def test_the_client_leaving_ends_its_subscriptions(service: Running, redis: Redis, names: Names) -> None:
    request = rid()
    async with connect(f"{service.ws_url}/v1/streams") as ws:
        await ws.send(subscribe(request))
        await append(redis, names, token_events(request, 0, 1))
        await ws.recv()
        assert await gauges(service) == {"sluicegate_relay_subscribers": 1, "sluicegate_relay_mux_sockets": 1}
    now: dict[str, float] = {}
    for _ in range(100):
        now = await gauges(service)
        if not any(now.values()):
            break
        await asyncio.sleep(0.05)
    assert now == {"sluicegate_relay_subscribers": 0, "sluicegate_relay_mux_sockets": 0}
    with pytest.raises(ConnectionClosed):
        await ws.recv()
