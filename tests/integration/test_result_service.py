"""The result service against a real Redis: WebSocket and SSE relays, resume, auth, fan-out, cancel.

Each test runs a real uvicorn server in-process on a free port and writes stream entries exactly as
the worker does (pipelined XADD with explicit ids ``0-<seq + 1>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from relay_support import (
    SECRET,
    TENANT,
    Running,
    append,
    count_connections,
    done_event,
    expected_token,
    open_unread_websocket,
    overflow_until_dropped,
    read_stream,
    receive_all,
    running_relay,
    start_server,
    token_events,
)
from websockets.asyncio.client import connect

from result_service.hub import RelayConfig, StreamHub
from result_service.wire import Relayed
from schemas import (
    STREAM_FIELD,
    CancelRequest,
    DoneEvent,
    ErrorEvent,
    Names,
    RequestRecord,
    RestartEvent,
    Usage,
    stream_entry_id,
    utcnow,
)
from sluicegate.redis_client import create_redis
from sluicegate.settings import Settings
from sluicegate.stream_subscription import SlowConsumer, Subscription
from sluicegate.stream_tokens import issue_stream_token

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture
def settings(redis_url: str, unique_prefix: str) -> Settings:
    return Settings(redis_url=redis_url, topic_prefix=unique_prefix, stream_token_secret=SECRET, ingress_port=1)


@pytest.fixture
def names(settings: Settings) -> Names:
    return Names(settings.topic_prefix)


@pytest.fixture
async def relay_config(request: pytest.FixtureRequest) -> RelayConfig:
    readers = getattr(request, "param", 1)
    return RelayConfig(readers=readers, client_name=f"result-test-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def service(settings: Settings, relay_config: RelayConfig) -> AsyncIterator[Running]:
    async with running_relay(settings, relay_config) as relay:
        yield relay


# --- WebSocket relay ---------------------------------------------------------------------------------


async def test_history_arrives_in_order_with_contract_json(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, [*token_events(rid, 0, 5), done_event(rid, 5)])

    got = await read_stream(service.stream_url(rid))

    assert got.code == 1000
    assert got.events[:5] == [expected_token(rid, seq) for seq in range(5)]
    assert got.events[5] == {
        "type": "done",
        "seq": 5,
        "request_id": rid,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "cached_tokens": 0},
        "id": "0-6",
    }
    assert len(got.events) == 6


async def test_waits_for_a_stream_that_does_not_exist_yet_then_relays_the_live_tail(
    service: Running, redis: Redis
) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    async with connect(service.stream_url(rid)) as ws:
        reader = asyncio.create_task(receive_all(ws))
        await asyncio.sleep(0.3)  # the request is "queued": no stream yet
        assert not reader.done()
        for seq in range(0, 30, 3):
            await append(redis, service.names, token_events(rid, seq, 3))
            await asyncio.sleep(0.01)
        await append(redis, service.names, [done_event(rid, 30)])
        got = await asyncio.wait_for(reader, 10)
    assert got.code == 1000
    assert [e["seq"] for e in got.events] == list(range(31))
    assert got.events[-1]["type"] == "done"


async def test_error_event_is_relayed_and_ends_the_stream(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    error = ErrorEvent(request_id=rid, seq=2, code="deadline_exceeded", message="too late")
    await append(redis, service.names, [*token_events(rid, 0, 2), error])
    got = await read_stream(service.stream_url(rid))
    assert got.code == 1000
    assert got.events[-1] == {
        "type": "error",
        "seq": 2,
        "request_id": rid,
        "code": "deadline_exceeded",
        "message": "too late",
        "id": "0-3",
    }


async def test_restart_event_is_relayed(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    restart = RestartEvent(request_id=rid, seq=4, discard_after_seq=1)
    events = [*token_events(rid, 0, 4), restart, *token_events(rid, 5, 2), done_event(rid, 7)]
    await append(redis, service.names, events)
    got = await read_stream(service.stream_url(rid))
    assert [e["type"] for e in got.events] == ["token"] * 4 + ["restart"] + ["token"] * 2 + ["done"]
    assert got.events[4] == {"type": "restart", "seq": 4, "request_id": rid, "discard_after_seq": 1, "id": "0-5"}


async def test_malformed_entries_are_skipped_live_and_in_history(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    key = service.names.stream_key(rid)
    async with connect(service.stream_url(rid)) as ws:
        live = asyncio.create_task(receive_all(ws))
        await append(redis, service.names, token_events(rid, 0, 2))
        await redis.xadd(key, {STREAM_FIELD: b"{not json"}, id=stream_entry_id(2))
        await redis.xadd(key, {b"unexpected": b"field"}, id=stream_entry_id(3))
        await append(redis, service.names, [*token_events(rid, 4, 1), done_event(rid, 5)])
        got = await asyncio.wait_for(live, 10)
    assert [e["seq"] for e in got.events] == [0, 1, 4, 5]
    history = await read_stream(service.stream_url(rid))
    assert [e["seq"] for e in history.events] == [0, 1, 4, 5]
    resumed = await read_stream(service.stream_url(rid, last_id=stream_entry_id(1)))
    assert [e["seq"] for e in resumed.events] == [4, 5]


async def test_reconnect_with_last_id_gets_the_rest_exactly_once(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, token_events(rid, 0, 10))
    async with connect(service.stream_url(rid)) as ws:
        first = await receive_all(ws, limit=4)
    assert [e["seq"] for e in first.events] == [0, 1, 2, 3]
    # The client dropped; generation went on meanwhile.
    await append(redis, service.names, token_events(rid, 10, 5))

    last_id = first.events[-1]["id"]
    async with connect(service.stream_url(rid, last_id=last_id)) as ws:
        reader = asyncio.create_task(receive_all(ws))
        await asyncio.sleep(0.1)
        await append(redis, service.names, [*token_events(rid, 15, 3), done_event(rid, 18)])
        rest = await asyncio.wait_for(reader, 10)
    assert rest.code == 1000
    assert [e["seq"] for e in rest.events] == list(range(4, 19))
    assert rest.events[0] == expected_token(rid, 4)


async def test_resume_after_the_end_closes_at_once(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, [*token_events(rid, 0, 2), done_event(rid, 2)])
    got = await asyncio.wait_for(read_stream(service.stream_url(rid, last_id=stream_entry_id(2))), 5)
    assert got.events == []
    assert got.code == 1000
    assert "finished" in got.reason


async def test_resume_past_the_end_of_a_running_stream_closes_when_it_ends(service: Running, redis: Redis) -> None:
    """The resume point lies at or past where the stream will end, which has not ended yet: the terminal event
    arrives behind the resume point, and the socket closes then (it once stayed open for good)."""
    rid = f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, token_events(rid, 0, 2))
    async with connect(service.stream_url(rid, last_id=stream_entry_id(5))) as ws:
        reader = asyncio.create_task(receive_all(ws))
        await asyncio.sleep(0.2)
        await append(redis, service.names, [done_event(rid, 2)])
        got = await asyncio.wait_for(reader, 5)
    assert got.events == [] and got.code == 1000
    assert got.reason == "stream finished at or before last_id: nothing after it"


async def test_expired_stream_of_a_finished_request_is_reported(service: Running, redis: Redis, names: Names) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    record = RequestRecord(
        request_id=rid, model="m", tenant=TENANT, priority="interactive", status="finished", created_at=utcnow()
    )
    await redis.set(names.request_key(rid), record.model_dump_json())
    got = await asyncio.wait_for(read_stream(service.stream_url(rid)), 5)
    assert got.code == 4404
    assert "expired" in got.reason


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("", "missing stream token"),
        ("acme.0000", "invalid stream token"),
        ("no-dot-here", "invalid stream token"),
        (issue_stream_token("another-secret", "x", TENANT, lifetime_s=3600), "invalid stream token"),
    ],
    # Fixed ids: a signed token carries its issue time, and pytest-xdist refuses a run whose workers collected
    # differently named tests.
    ids=["empty", "bad-signature", "no-dot", "another-secret"],
)
async def test_bad_tokens_are_refused_with_1008(service: Running, redis: Redis, token: str, reason: str) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, [*token_events(rid, 0, 2), done_event(rid, 2)])
    got = await read_stream(service.stream_url(rid, token=token))
    assert got.code == 1008
    assert reason in got.reason
    assert got.events == []


async def test_an_expired_token_is_refused_saying_so_over_websocket_and_sse(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, [*token_events(rid, 0, 2), done_event(rid, 2)])
    expired = issue_stream_token(SECRET, rid, TENANT, lifetime_s=60, now=time.time() - 61)
    got = await read_stream(service.stream_url(rid, token=expired))
    assert got.code == 1008
    assert "stream token expired at" in got.reason
    assert got.events == []
    async with httpx.AsyncClient(base_url=service.http_url, timeout=10) as client:
        refused = await client.get(f"/v1/streams/{rid}/sse", params={"token": expired})
    assert refused.status_code == 401
    assert "stream token expired at" in refused.json()["detail"]


async def test_token_for_another_request_is_refused(service: Running, redis: Redis) -> None:
    rid, other = f"req-{uuid.uuid4().hex[:8]}", f"req-{uuid.uuid4().hex[:8]}"
    await append(redis, service.names, [*token_events(rid, 0, 2), done_event(rid, 2)])
    got = await read_stream(service.stream_url(rid, token=issue_stream_token(SECRET, other, TENANT, lifetime_s=3600)))
    assert got.code == 1008
    assert "invalid stream token" in got.reason
    assert got.events == []


async def test_malformed_last_id_and_request_id_are_refused(service: Running) -> None:
    got = await read_stream(service.stream_url("req-1", last_id="1700000000000-0"))
    assert got.code == 1008
    assert "last_id" in got.reason
    bad_id = "bad!id"
    url = service.stream_url(bad_id, token=issue_stream_token(SECRET, bad_id, TENANT, lifetime_s=3600)).replace(
        "!", "%21"
    )
    got = await read_stream(url)
    assert got.code == 1008
    assert "request id" in got.reason


async def test_a_websocket_where_none_is_served_is_told_where_the_streams_are(service: Running) -> None:
    """The SSE path, or any other, answers a WebSocket with a close that names the right path (it was a bare 403)."""
    rid = uuid.uuid4().hex  # as long as ingress's ids: the hint must fit in a close reason's 123 bytes
    sse = await read_stream(service.stream_url(rid).replace(f"/v1/streams/{rid}?", f"/v1/streams/{rid}/sse?"))
    assert sse.code == 1008 and sse.reason == f"Server-Sent Events here (GET); the WebSocket is /v1/streams/{rid}"
    other = await read_stream(f"{service.ws_url}/v2/nothing")
    assert other.code == 1008 and other.reason.startswith("no WebSocket here: a stream is /v1/streams/<request_id>")
    async with httpx.AsyncClient() as http:  # HTTP on those paths is unchanged
        assert (await http.get(f"{service.http_url}/v2/nothing")).status_code == 404


@pytest.mark.parametrize("message", [json.dumps({"type": "hello"}), "[" * 5000 + "]" * 5000], ids=["unknown", "deep"])
async def test_unsupported_client_message_closes_with_1008(service: Running, message: str) -> None:
    """Anything but a cancel, JSON nested past Python's recursion limit too (it once dropped the connection
    without a close frame)."""
    rid = f"req-{uuid.uuid4().hex[:8]}"
    async with connect(service.stream_url(rid)) as ws:
        await ws.send(message)
        got = await asyncio.wait_for(receive_all(ws), 5)
    assert got.code == 1008
    assert "cancel" in got.reason


async def test_cancel_message_sets_marker_and_publishes_control_message(
    redis_url: str, kafka_bootstrap: str, unique_prefix: str, relay_config: RelayConfig
) -> None:
    settings = Settings(
        redis_url=redis_url, kafka_bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, stream_token_secret=SECRET
    )
    names = Names(unique_prefix)
    consumer = AIOKafkaConsumer(
        names.control_topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", group_id=None
    )
    server, task, address = await start_server(settings, relay_config)
    redis = create_redis(settings)
    rid = f"req-{uuid.uuid4().hex[:8]}"
    try:
        url = Running(settings, names, relay_config.client_name, "", f"ws://{address}").stream_url(rid)
        async with connect(url) as ws:
            await append(redis, names, token_events(rid, 0, 2))
            assert json.loads(await ws.recv())["seq"] == 0
            await ws.send(json.dumps({"type": "cancel"}))
            for _ in range(100):
                if await redis.exists(names.cancel_key(rid)):
                    break
                await asyncio.sleep(0.05)
            marker = await redis.get(names.cancel_key(rid))
            assert marker is not None
            assert CancelRequest.model_validate_json(marker).request_id == rid
            assert 0 < await redis.ttl(names.cancel_key(rid)) <= settings.stream_ttl_s
            # The worker answers a cancellation with done(abort); the relay passes it on and closes.
            abort = DoneEvent(
                request_id=rid,
                seq=2,
                finish_reason="abort",
                usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
            )
            await append(redis, names, [abort])
            rest = await asyncio.wait_for(receive_all(ws), 10)
        assert [e["seq"] for e in rest.events] == [1, 2]
        assert rest.events[-1]["finish_reason"] == "abort"
        assert rest.code == 1000

        await consumer.start()
        batch = await consumer.getmany(timeout_ms=15_000)
        messages = [CancelRequest.model_validate_json(m.value) for records in batch.values() for m in records]
        assert [(m.request_id, m.tenant) for m in messages] == [(rid, TENANT)]
    finally:
        await consumer.stop()
        server.should_exit = True
        await asyncio.wait_for(task, 15)
        keys = [key async for key in redis.scan_iter(match=f"{unique_prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


# --- fan-out -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("relay_config", [1, 2], indirect=True, ids=["1-reader", "2-readers"])
async def test_100_clients_on_shared_and_separate_streams_get_everything_over_few_connections(
    service: Running, redis: Redis, relay_config: RelayConfig
) -> None:
    # 5 streams with 16 clients each, 20 streams with 1 client each: 100 clients on 25 streams.
    shared = [f"shared-{i}-{uuid.uuid4().hex[:6]}" for i in range(5)]
    single = [f"single-{i}-{uuid.uuid4().hex[:6]}" for i in range(20)]
    clients = [rid for rid in shared for _ in range(16)] + single
    assert len(clients) == 100
    n_tokens = 60

    sockets = [await connect(service.stream_url(rid)).__aenter__() for rid in clients]
    try:
        readers = [asyncio.create_task(receive_all(ws)) for ws in sockets]
        await asyncio.sleep(0.2)
        for start in range(0, n_tokens, 6):  # like a worker: one pipeline per engine step
            await append(redis, service.names, [e for rid in shared + single for e in token_events(rid, start, 6)])
            await asyncio.sleep(0.005)
        during = await count_connections(redis, service.client_name)
        await append(redis, service.names, [done_event(rid, n_tokens) for rid in shared + single])
        results = await asyncio.wait_for(asyncio.gather(*readers), 60)
    finally:
        for ws in sockets:
            await ws.close()

    for rid, got in zip(clients, results, strict=True):
        assert got.code == 1000, (rid, got.code, got.reason)
        assert [e["seq"] for e in got.events] == list(range(n_tokens + 1)), rid
        assert got.events[7] == expected_token(rid, 7)
    # One reader connection plus the bounded pool for short commands, whatever the client count.
    assert 1 <= during <= relay_config.readers + relay_config.max_commands


async def test_late_subscriber_joins_the_live_fanout_without_gaps_or_duplicates(redis: Redis, names: Names) -> None:
    hub = StreamHub(redis, names, RelayConfig(history_page=7))
    await hub.start()
    rid = f"req-{uuid.uuid4().hex[:8]}"
    try:

        async def consume(after: int) -> list[int]:
            seen: list[int] = []
            async with hub.subscribe(rid, after) as sub:
                while not sub.finished:
                    seen.extend(item.seq for item in await sub.next_batch())
            return seen

        early = asyncio.create_task(consume(-1))
        late: list[asyncio.Task[list[int]]] = []
        for step in range(40):
            await append(redis, names, token_events(rid, step * 5, 5))
            if step in (3, 11, 25):
                late.append(asyncio.create_task(consume(-1)))
                late.append(asyncio.create_task(consume(step * 2)))
            await asyncio.sleep(0.002)
        await append(redis, names, [done_event(rid, 200)])
        assert await asyncio.wait_for(early, 10) == list(range(201))
        for i, task in enumerate(late):
            after = -1 if i % 2 == 0 else (3, 11, 25)[i // 2] * 2
            assert await asyncio.wait_for(task, 10) == list(range(after + 1, 201))
        assert hub.stream_count == 0  # the last subscriber left: nothing is read for it any more
    finally:
        await hub.close()


async def test_late_subscriber_history_pages_skip_malformed_entries(redis: Redis, names: Names) -> None:
    hub = StreamHub(redis, names, RelayConfig(history_page=1))
    await hub.start()
    rid = f"req-{uuid.uuid4().hex[:8]}"
    key = names.stream_key(rid)
    try:
        async with hub.subscribe(rid) as first:
            await append(redis, names, token_events(rid, 0, 2))
            await redis.xadd(key, {STREAM_FIELD: b"{not json"}, id=stream_entry_id(2))
            await redis.xadd(key, {b"unexpected": b"field"}, id=stream_entry_id(3))
            await append(redis, names, token_events(rid, 4, 1))
            seen: list[int] = []
            while 4 not in seen:
                seen.extend(item.seq for item in await asyncio.wait_for(first.next_batch(), 5))
            async with hub.subscribe(rid) as late:  # joins after the reader passed seq 4: XRANGE pages
                await append(redis, names, [done_event(rid, 5)])
                late_seen: list[int] = []
                while not late.finished:
                    late_seen.extend(item.seq for item in await asyncio.wait_for(late.next_batch(), 5))
        assert seen == [0, 1, 4]
        assert late_seen == [0, 1, 4, 5]
    finally:
        await hub.close()


@contextlib.asynccontextmanager
async def reader_blocked_elsewhere(redis: Redis, names: Names) -> AsyncIterator[tuple[StreamHub, str]]:
    """A hub whose reader is parked on another stream with a block far longer than any test, and a new request id:
    only a wake-up (CLIENT UNBLOCK) can make the reader pick up that request's stream."""
    hub = StreamHub(redis, names, RelayConfig(block_ms=30_000))
    await hub.start()
    try:
        async with hub.subscribe(f"req-{uuid.uuid4().hex[:8]}"):
            await asyncio.sleep(0.2)  # the reader is now blocked on that stream alone
            yield hub, f"req-{uuid.uuid4().hex[:8]}"
    finally:
        await hub.close()


async def first_live_event(redis: Redis, names: Names, sub: Subscription[Relayed], request_id: str) -> list[int]:
    await asyncio.sleep(0.05)
    await append(redis, names, token_events(request_id, 0, 1))
    return [item.seq for item in await asyncio.wait_for(sub.next_batch(), 2)]


async def test_a_new_stream_wakes_the_blocked_reader_at_once(redis: Redis, names: Names) -> None:
    async with reader_blocked_elsewhere(redis, names) as (hub, rid), hub.subscribe(rid) as sub:
        assert await first_live_event(redis, names, sub, rid) == [0]


async def test_a_new_subscribers_probe_carries_the_readers_wake_up(
    redis: Redis, names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the WebSocket relay does: subscribe without a wake-up of its own, then probe in one pipeline that also
    # unblocks the reader. A separate CLIENT UNBLOCK would fail the test; only the pipelined one may wake it.
    async def no_separate_unblock(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("the wake-up took a round trip of its own")

    async with reader_blocked_elsewhere(redis, names) as (hub, rid):
        monkeypatch.setattr(redis, "client_unblock", no_separate_unblock)
        async with hub.subscribe(rid, wake=False) as sub:
            pipe = redis.pipeline(transaction=False)
            pipe.exists(names.stream_key(rid))
            assert await hub.execute_waking(sub, pipe) == [0]  # the caller's replies, not the wake-up's
            assert await first_live_event(redis, names, sub, rid) == [0]


async def test_a_failed_probe_pipeline_still_wakes_the_reader(redis: Redis, names: Names) -> None:
    not_a_number = f"{names.prefix}:not-a-number:{uuid.uuid4().hex[:8]}"
    await redis.set(not_a_number, "text", ex=60)
    try:
        async with reader_blocked_elsewhere(redis, names) as (hub, rid), hub.subscribe(rid, wake=False) as sub:
            pipe = redis.pipeline(transaction=False)
            pipe.incr(not_a_number)
            with pytest.raises(ResponseError):
                await hub.execute_waking(sub, pipe)
            # Whatever the caller's pipeline did, the reader's own wake-up takes over.
            assert await first_live_event(redis, names, sub, rid) == [0]
    finally:
        await redis.delete(not_a_number)


async def test_reader_survives_a_killed_connection(settings: Settings, redis: Redis, names: Names) -> None:
    client_name = f"result-test-{uuid.uuid4().hex[:8]}"
    hub_client = create_redis(settings, client_name=client_name)
    hub = StreamHub(hub_client, names, RelayConfig(block_ms=200, client_name=client_name))
    await hub.start()
    rid = f"req-{uuid.uuid4().hex[:8]}"
    try:
        async with hub.subscribe(rid) as sub:
            await append(redis, names, token_events(rid, 0, 3))
            seen = [item.seq for item in await asyncio.wait_for(sub.next_batch(), 5)]
            while len(seen) < 3:
                seen.extend(item.seq for item in await asyncio.wait_for(sub.next_batch(), 5))
            readers = [c for c in await redis.client_list() if c.get("name") == client_name and c.get("cmd") == "xread"]
            assert readers, "the reader should be blocked in XREAD"
            await redis.client_kill_filter(_id=readers[0]["id"])
            await append(redis, names, [*token_events(rid, 3, 3), done_event(rid, 6)])
            while not sub.finished:
                seen.extend(item.seq for item in await asyncio.wait_for(sub.next_batch(), 10))
        assert seen == list(range(7))
    finally:
        await hub.close()
        await hub_client.aclose()


async def test_slow_subscriber_is_dropped_and_resumes_losslessly(redis: Redis, names: Names) -> None:
    hub = StreamHub(redis, names, RelayConfig(max_pending=8))
    await hub.start()
    rid = f"req-{uuid.uuid4().hex[:8]}"
    try:
        async with hub.subscribe(rid) as fast, hub.subscribe(rid) as slow:
            got: list[int] = []
            await append(redis, names, token_events(rid, 0, 4))
            while len(got) < 4:
                got.extend(item.seq for item in await slow.next_batch())
            for start in range(0, 40, 4):  # slow stops reading here
                if start:
                    await append(redis, names, token_events(rid, start, 4))
                while fast.last_seq < start + 3:  # the fast one is never held back by the slow one
                    await asyncio.wait_for(fast.next_batch(), 5)
            with pytest.raises(SlowConsumer):
                while True:
                    await slow.next_batch()
            resume_after = slow.last_seq
        assert resume_after == 3
        async with hub.subscribe(rid, resume_after) as again:
            await append(redis, names, [done_event(rid, 40)])
            rest: list[int] = []
            while not again.finished:
                rest.extend(item.seq for item in await again.next_batch())
        assert got + rest == list(range(41))
    finally:
        await hub.close()


async def test_websocket_client_that_stops_reading_is_dropped_with_1013_and_resumes_exactly_once(
    settings: Settings, redis: Redis, names: Names
) -> None:
    config = RelayConfig(max_pending=16, read_count=16, client_name=f"result-test-{uuid.uuid4().hex[:8]}")
    server, task, address = await start_server(settings, config)
    rid = f"req-{uuid.uuid4().hex[:8]}"
    running = Running(settings, names, config.client_name, "", f"ws://{address}")
    try:
        unread = await open_unread_websocket(running.stream_url(rid))
        first = await overflow_until_dropped(redis, names, rid, unread)
        seqs = [e["seq"] for e in first.events]

        await append(redis, names, [done_event(rid, 300)])
        async with connect(running.stream_url(rid, last_id=first.events[-1]["id"]), max_size=2**20) as ws:
            rest = await asyncio.wait_for(receive_all(ws), 20)
        assert rest.code == 1000
        assert seqs + [e["seq"] for e in rest.events] == list(range(301))
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


# --- SSE -------------------------------------------------------------------------------------------


def parse_sse(body: str) -> list[tuple[str | None, dict[str, Any]]]:
    events = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            events.append((fields.get("id"), json.loads(fields["data"])))
    return events


async def test_sse_relays_and_honours_last_event_id(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    token = issue_stream_token(SECRET, rid, TENANT, lifetime_s=3600)
    await append(redis, service.names, [*token_events(rid, 0, 6), done_event(rid, 6)])
    async with httpx.AsyncClient(base_url=service.http_url, timeout=10) as client:
        response = await client.get(
            f"/v1/streams/{rid}", params={"token": token}, headers={"Accept": "text/event-stream"}
        )
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.text)
        assert [entry_id for entry_id, _ in events] == [stream_entry_id(s) for s in range(7)]
        assert events[2][1] == expected_token(rid, 2)

        resumed = await client.get(
            f"/v1/streams/{rid}/sse", params={"token": token}, headers={"Last-Event-ID": stream_entry_id(3)}
        )
        assert [event["seq"] for _, event in parse_sse(resumed.text)] == [4, 5, 6]

        # EventSource reconnects after the response ends; 204 tells it to stop.
        after_end = await client.get(
            f"/v1/streams/{rid}/sse", params={"token": token}, headers={"Last-Event-ID": stream_entry_id(6)}
        )
        assert after_end.status_code == 204

        refused = await client.get(f"/v1/streams/{rid}/sse", params={"token": "acme.beef"})
        assert refused.status_code == 401
        assert "invalid stream token" in refused.json()["detail"]
        assert refused.headers["www-authenticate"].startswith("Bearer ")  # RFC 9110: a 401 names its scheme
        # The token in the Authorization header, for SSE clients that can set one.
        bearer = await client.get(f"/v1/streams/{rid}/sse", headers={"Authorization": f"Bearer {token}"})
        assert [event["seq"] for _, event in parse_sse(bearer.text)] == list(range(7))
        not_sse = await client.get(f"/v1/streams/{rid}", params={"token": token})
        assert not_sse.status_code == 406

        # From a page of another origin that ingress lets submit (the chat page at localhost, say), an EventSource
        # may follow the stream too; a foreign page's gets no CORS grant (the browser keeps the events from it).
        allowed = f"http://localhost:{service.settings.result_port}"
        for origin, granted in ((allowed, True), ("http://evil.example", False)):
            crossed = await client.get(f"/v1/streams/{rid}/sse", params={"token": token}, headers={"Origin": origin})
            assert (crossed.headers.get("access-control-allow-origin") == origin) is granted, crossed.headers
            preflight = await client.options(
                f"/v1/streams/{rid}/sse",
                headers={
                    "Origin": origin,
                    "Access-Control-Request-Method": "GET",
                    "Access-Control-Request-Headers": "last-event-id",
                },
            )
            assert (preflight.status_code == 200) is granted, preflight.text


async def test_sse_live_tail(service: Running, redis: Redis) -> None:
    rid = f"req-{uuid.uuid4().hex[:8]}"
    token = issue_stream_token(SECRET, rid, TENANT, lifetime_s=3600)

    async def produce() -> None:
        await asyncio.sleep(0.2)
        for seq in range(0, 10, 2):
            await append(redis, service.names, token_events(rid, seq, 2))
        await append(redis, service.names, [done_event(rid, 10)])

    producer = asyncio.create_task(produce())
    async with httpx.AsyncClient(base_url=service.http_url, timeout=10) as client:
        response = await client.get(f"/v1/streams/{rid}/sse", params={"token": token, "last_id": "0-0"})
    await producer
    assert [event["seq"] for _, event in parse_sse(response.text)] == list(range(11))


# --- page ----------------------------------------------------------------------------------------------


async def test_chat_page_and_its_config_are_served(service: Running) -> None:
    async with httpx.AsyncClient(base_url=service.http_url, timeout=10) as client:
        page = await client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert 'id="composer"' in page.text
        assert "/static/chat.js" in page.text
        for path in ("/", "/healthz", "/health", "/readyz"):  # uptime checks send HEAD
            head = await client.head(path)
            assert head.status_code == 200 and head.content == b"", path
        for path in ("/health", "/readyz"):  # ingress's names for the same checks
            assert (await client.get(path)).json()["status"] == "ok", path
        vendored_files = ("/static/vendor/marked.umd.js", "/static/vendor/purify.min.js", "/static/markdown.js")
        for vendored in (*vendored_files, "/static/refusals.js", "/static/reply_stream.js", "/static/chat_session.js"):
            assert (await client.get(vendored)).status_code == 200, vendored
        script = await client.get("/static/chat.js")
        assert script.status_code == 200
        assert "/v1/requests" in script.text
        assert "last_id" in script.text
        config = (await client.get("/config.json")).json()
        assert config["ingress_url"] == "http://127.0.0.1:1"
        assert config["models"] == []
        assert "models_error" in config
        health = await client.get("/healthz")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
