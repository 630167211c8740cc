"""The native API end to end on real Kafka, Redis and service processes.

Submit with ``POST /v1/requests`` and read the token stream over the result service's WebSocket (whole,
and resumed with ``last_id`` after a mid-stream disconnect); Kafka-native producers on ``llm.inbound``
(served and streamed, or dead-lettered with a ``reason`` header naming the bad field); two workers
sharing one consumer group. The two-worker test runs last and stops its extra worker, so the module's
other tests see one worker.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Iterable
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from schemas import TERMINAL_TYPES, DeadLetter, FinalResult, InferenceRequest, Names, SamplingOptions, stream_entry_id
from schemas.names import HEADER_REASON, HEADER_REQUEST_ID
from sluicegate.kafka import create_consumer, create_producer
from sluicegate.stream_tokens import issue_stream_token

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLOSE_NORMAL = 1000
CLOSE_POLICY_VIOLATION = 1008


# --- helpers -----------------------------------------------------------------------------------------------


def ws_base(pipeline: Pipeline) -> str:
    """The result service's WebSocket base URL."""
    return pipeline.result_url.replace("http://", "ws://", 1)


async def read_ws(url: str, *, stop_after: int | None = None, timeout_s: float = 60) -> tuple[list[dict], int | None]:
    """Events from one WebSocket connection to ``url``.

    Reads until the terminal event and returns the close code the server then sends; or, with
    ``stop_after``, hangs up itself after that many events and returns None for the code.
    """
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    async with connect(url, open_timeout=10, compression=None) as ws:
        while True:
            raw = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
            events.append(json.loads(raw))
            if events[-1]["type"] in TERMINAL_TYPES:
                await asyncio.wait_for(ws.wait_closed(), 10)
                return events, ws.close_code
            if stop_after is not None and len(events) >= stop_after:
                return events, None


async def close_code_without_events(url: str) -> int | None:
    """The code the server closes with, asserting it sends no event first."""
    async with connect(url, open_timeout=10, compression=None) as ws:
        try:
            message = await asyncio.wait_for(ws.recv(), 10)
        except ConnectionClosed:
            return ws.close_code
        raise AssertionError(f"expected no event, got {message!r}")


def assert_complete_stream(events: list[dict[str, Any]], request_id: str) -> None:
    """Seq runs 0, 1, 2... with matching entry ids, token events then one ``done``."""
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert [e["id"] for e in events] == [stream_entry_id(e["seq"]) for e in events]
    assert all(e["request_id"] == request_id for e in events)
    assert [e["type"] for e in events[:-1]] == ["token"] * (len(events) - 1)
    assert events[-1]["type"] == "done", events[-1]


def text_of(events: Iterable[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "token")


def token_ids_of(events: Iterable[dict[str, Any]]) -> list[int]:
    return [t for e in events if e["type"] == "token" for t in e["token_ids"]]


async def api(pipeline: Pipeline, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One call to ingress with the pipeline's API key."""
    async with httpx.AsyncClient(base_url=pipeline.ingress_url, headers=pipeline.headers(), timeout=30) as client:
        return await client.request(method, path, **kwargs)


async def submit(pipeline: Pipeline, **body: Any) -> dict[str, Any]:
    """``POST /v1/requests`` for the pipeline's model; the 202 body."""
    response = await api(pipeline, "POST", "/v1/requests", json={"model": pipeline.model, **body})
    assert response.status_code == 202, response.text
    return response.json()


async def wait_record(pipeline: Pipeline, request_id: str, status: str = "finished", timeout_s: float = 30) -> dict:
    """``GET /v1/requests/{id}`` until it reports ``status``."""
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = await api(pipeline, "GET", f"/v1/requests/{request_id}")
        assert response.status_code == 200, response.text
        body = response.json()
        if body["status"] == status:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"request {request_id} not {status} within {timeout_s}s: {body}")


def native_request(pipeline: Pipeline, *, max_tokens: int = 8, tenant: str = "kafka-native", **fields: Any) -> dict:
    """A JSON InferenceRequest as a Kafka-native producer would write it (``fields`` override or add)."""
    request = InferenceRequest(
        request_id=f"kn-{uuid.uuid4().hex[:12]}",
        model=pipeline.model,
        prompt="The river ran quietly past the old mill",
        sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        tenant=tenant,
    )
    return {**request.model_dump(mode="json"), **fields}


async def produce_inbound(pipeline: Pipeline, bodies: list[dict[str, Any]], *, key: str | None = None) -> None:
    """Put each body on ``llm.inbound`` (acknowledged, in order), keyed by ``key`` or else its request id."""
    producer = create_producer(bootstrap=pipeline.kafka_bootstrap, client_id="e2e-native-producer")
    await producer.start()
    try:
        for body in bodies:
            record_key = (key or str(body.get("request_id", ""))).encode() or None
            await producer.send_and_wait(
                Names(pipeline.prefix).inbound_topic, json.dumps(body).encode(), key=record_key
            )
    finally:
        await producer.stop()


async def read_topic(
    pipeline: Pipeline, topic: str, wanted: set[str], *, timeout_s: float = 30
) -> dict[str, tuple[bytes, dict[str, bytes]]]:
    """Records of ``topic`` (from the beginning) keyed by the ``request_id`` in their JSON value, until every
    id in ``wanted`` was seen: ``{request_id: (value, headers)}``."""
    consumer: AIOKafkaConsumer = create_consumer(
        topic, group_id=None, bootstrap=pipeline.kafka_bootstrap, client_id="e2e-native-reader"
    )
    await consumer.start()
    found: dict[str, tuple[bytes, dict[str, bytes]]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not wanted <= found.keys():
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}: missing {sorted(wanted - found.keys())} after {timeout_s}s")
            batch = await consumer.getmany(timeout_ms=500)
            for record in (r for records in batch.values() for r in records):
                body = json.loads(record.value)
                if body.get("request_id") in wanted:
                    found[body["request_id"]] = (record.value, dict(record.headers or ()))
    finally:
        await consumer.stop()
    return found


# --- native API + WebSocket ---------------------------------------------------------------------------------


async def test_submit_then_stream_over_websocket_matches_status(pipeline: Pipeline) -> None:
    submitted = await submit(pipeline, prompt="Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
    rid = submitted["request_id"]
    assert submitted["status"] == "queued"
    assert submitted["stream_url"] == f"{ws_base(pipeline)}/v1/streams/{rid}"
    assert submitted["stream_token"]

    events, code = await read_ws(f"{submitted['stream_url']}?token={submitted['stream_token']}")
    assert_complete_stream(events, rid)
    assert code == CLOSE_NORMAL
    done = events[-1]
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 12 == len(token_ids_of(events))

    record = await wait_record(pipeline, rid)
    assert record["worker_id"] == "worker-a"
    assert record["result"]["text"] == text_of(events)
    assert record["result"]["token_ids"] == token_ids_of(events)
    assert record["result"]["usage"] == done["usage"]

    # A finished request cannot be cancelled; an unknown one does not exist.
    cancel = await api(pipeline, "DELETE", f"/v1/requests/{rid}")
    assert cancel.status_code == 409, cancel.text
    missing = await api(pipeline, "GET", f"/v1/requests/nope-{rid}")
    assert missing.status_code == 404

    # The token opens this stream only.
    assert await close_code_without_events(f"{submitted['stream_url']}?token=x.{'0' * 64}") == CLOSE_POLICY_VIOLATION
    other = await submit(pipeline, prompt="hi", max_tokens=1)
    wrong = f"{ws_base(pipeline)}/v1/streams/{other['request_id']}?token={submitted['stream_token']}"
    assert await close_code_without_events(wrong) == CLOSE_POLICY_VIOLATION


async def disconnect_and_resume(pipeline: Pipeline, max_tokens: int) -> bool:
    """Read a long stream's first 3 events, hang up, resume with ``last_id``; check every event arrives once and
    in order, as in an uninterrupted read. True when the worker was still generating at the hang-up."""
    prompt = "They counted one, two, three"
    submitted = await submit(pipeline, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rid, token = submitted["request_id"], submitted["stream_token"]
    url = f"{submitted['stream_url']}?token={token}"

    first, code = await read_ws(url, stop_after=3)
    assert code is None and len(first) == 3
    live = not any(e.type in TERMINAL_TYPES for e in pipeline.stream_events(rid))
    rest, code = await read_ws(f"{url}&last_id={first[-1]['id']}")
    assert code == CLOSE_NORMAL
    resumed = first + rest
    assert_complete_stream(resumed, rid)  # no seq repeated or missing across the seam

    whole, _ = await read_ws(url)  # the same stream read without interruption
    assert whole == resumed
    assert whole[-1]["usage"]["completion_tokens"] == max_tokens
    assert text_of(resumed) == (await wait_record(pipeline, rid))["result"]["text"]

    # Resuming after the terminal event gets nothing more and a normal close.
    assert await close_code_without_events(f"{url}&last_id={whole[-1]['id']}") == CLOSE_NORMAL
    return live


async def test_reconnect_with_last_id_delivers_every_token_once(pipeline: Pipeline) -> None:
    # 800 tokens take the tiny model a second or more, and the first events normally arrive within tens of
    # milliseconds; on a stalled machine the whole stream may be written before the client hangs up, and
    # that attempt (still checked) is repeated, so that one resume surely joins a live stream.
    attempts = [await disconnect_and_resume(pipeline, 800)]
    while not attempts[-1] and len(attempts) < 3:
        attempts.append(await disconnect_and_resume(pipeline, 800))
    assert attempts[-1], "the stream had always ended before the client hung up"


# --- Kafka-native producers ---------------------------------------------------------------------------------


async def test_kafka_native_request_is_routed_and_streamed(pipeline: Pipeline) -> None:
    body = native_request(pipeline, max_tokens=10)
    rid, tenant = body["request_id"], body["tenant"]
    await produce_inbound(pipeline, [body])

    secret = pipeline.env["SLUICEGATE_STREAM_TOKEN_SECRET"]
    url = f"{ws_base(pipeline)}/v1/streams/{rid}?token={issue_stream_token(secret, rid, tenant, lifetime_s=3600)}"
    events, code = await read_ws(url)
    assert_complete_stream(events, rid)
    assert code == CLOSE_NORMAL
    assert events[-1]["usage"]["completion_tokens"] == 10

    # The same tokens as the worker appended them, and the durable final result on llm.results.
    stored = pipeline.stream_events(rid)
    assert [e.model_dump(mode="json") for e in stored] == [{k: v for k, v in e.items() if k != "id"} for e in events]
    results = await read_topic(pipeline, Names(pipeline.prefix).results_topic, {rid})
    final = FinalResult.model_validate_json(results[rid][0])
    assert (final.text, final.token_ids, final.tenant) == (text_of(events), token_ids_of(events), tenant)
    assert final.worker_id == "worker-a"


async def test_invalid_inbound_messages_go_to_dlq_with_the_field_named(pipeline: Pipeline) -> None:
    bad_tier = native_request(pipeline, priority="urgent")
    bad_temperature = native_request(pipeline)
    bad_temperature["sampling"] = {**bad_temperature["sampling"], "temperature": 7.5}
    good = native_request(pipeline, max_tokens=4)
    # Brackets nested deeper than Python's recursion limit: once a RecursionError that crashed the router on
    # every start (the record was never committed). Its id travels in the record's header.
    deep_id = f"deep-{uuid.uuid4().hex[:8]}"
    deep = b'{"request_id": "' + deep_id.encode() + b'", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    producer = create_producer(bootstrap=pipeline.kafka_bootstrap, client_id="e2e-native-producer")
    await producer.start()
    try:
        await producer.send_and_wait(
            Names(pipeline.prefix).inbound_topic, deep, key=b"dlq-test", headers=[(HEADER_REQUEST_ID, deep_id.encode())]
        )
    finally:
        await producer.stop()
    # One key puts them all on one partition, the good one last: the router keeps going past bad records.
    await produce_inbound(pipeline, [bad_tier, bad_temperature, good], key="dlq-test")

    letters = await read_topic(
        pipeline, Names(pipeline.prefix).dlq_topic, {bad_tier["request_id"], bad_temperature["request_id"], deep_id}
    )
    deep_letter = DeadLetter.model_validate_json(letters[deep_id][0])
    assert deep_letter.reason == "invalid_json" and "nested too deeply" in deep_letter.detail, deep_letter.detail
    for body, field in ((bad_tier, "priority"), (bad_temperature, "sampling.temperature")):
        value, headers = letters[body["request_id"]]
        letter = DeadLetter.model_validate_json(value)
        assert headers[HEADER_REASON] == f"schema_violation:{field}".encode()
        assert letter.reason == f"schema_violation:{field}"
        assert field in letter.detail
        assert headers[HEADER_REQUEST_ID] == body["request_id"].encode()
        assert letter.source_topic == Names(pipeline.prefix).inbound_topic
        assert json.loads(letter.payload) == body
        # Nothing was served for it; its stream says why, for a client that reads only the stream (written once
        # the router's batch is committed, a moment after the dead letter).
        (refusal,) = pipeline.wait_stream_end(body["request_id"], timeout_s=30)
        assert refusal.type == "error" and refusal.code == "schema_violation" and field in refusal.message, refusal

    events = pipeline.wait_stream_end(good["request_id"])
    assert events[-1].type == "done" and events[-1].usage.completion_tokens == 4


# --- two workers in one group -------------------------------------------------------------------------------


def all_partitions(pipeline: Pipeline) -> set[tuple[str, int]]:
    count = int(pipeline.env["SLUICEGATE_TOPIC_PARTITIONS"])
    return {(topic, p) for topic in Names(pipeline.prefix).request_topics(pipeline.model) for p in range(count)}


def wait_ownership(pipeline: Pipeline, workers: set[str], timeout_s: float = 60) -> dict[str, set[tuple[str, int]]]:
    """Until the fresh heartbeats of exactly ``workers`` split every request partition among them, each owning
    some and none owned twice; returns worker id -> partitions."""
    expected = all_partitions(pipeline)
    deadline = time.monotonic() + timeout_s
    owned: dict[str, set[tuple[str, int]]] = {}
    while time.monotonic() < deadline:
        beats = {w: b for w, b in pipeline.heartbeats().items() if time.time() - b.sent_at.timestamp() < 2}
        owned = {w: {(p.topic, p.partition) for p in b.partitions} for w, b in beats.items()}
        counted = sum(len(parts) for parts in owned.values())
        union = set().union(*owned.values()) if owned else set()
        if set(owned) == workers and all(owned.values()) and union == expected and counted == len(expected):
            return owned
        time.sleep(0.2)
    raise AssertionError(f"partitions not split among {sorted(workers)} within {timeout_s}s: {owned}")


async def test_two_workers_share_partitions_and_both_serve(pipeline: Pipeline) -> None:
    worker_b = pipeline.start_worker("worker-b")
    try:
        pipeline.wait_workers(2)
        owned = await asyncio.to_thread(wait_ownership, pipeline, {"worker-a", "worker-b"})
        assert not owned["worker-a"] & owned["worker-b"]

        # Prompts (and tiers) differ, so their affinity keys land on both workers' partitions.
        served_by: dict[str, str] = {}
        tiers = ["standard", "batch", "interactive"]
        for i in range(24):
            prompt = f"request number {i}: the baker opened his shop"
            submitted = await submit(pipeline, prompt=prompt, max_tokens=4, temperature=0, priority=tiers[i % 3])
            rid = submitted["request_id"]
            record = await wait_record(pipeline, rid)
            served_by[rid] = record["worker_id"]
            if i >= 5 and set(served_by.values()) == {"worker-a", "worker-b"}:
                break
        assert set(served_by.values()) == {"worker-a", "worker-b"}, served_by

        # The durable results name the same workers.
        results = await read_topic(pipeline, Names(pipeline.prefix).results_topic, set(served_by))
        named = {rid: FinalResult.model_validate_json(value).worker_id for rid, (value, _) in results.items()}
        assert named == served_by
    finally:
        await asyncio.to_thread(pipeline.kill, worker_b, signal.SIGTERM)
    assert worker_b.process.returncode == 0, worker_b.log()
    # A clean stop ends with the worker's last line, not with an interpreter teardown's noise.
    assert "worker.stopped" in worker_b.log() and "leaked" not in worker_b.log(), worker_b.log()
    # worker-b left the group on its way out: worker-a owns everything again.
    owned = await asyncio.to_thread(wait_ownership, pipeline, {"worker-a"})
    assert owned["worker-a"] == all_partitions(pipeline)
