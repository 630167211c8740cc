"""Deadlines, poison messages and the DLQ tools on the real pipeline.

A worker that picks up an expired request does not run it: ``error`` / ``deadline_exceeded`` in the stream and
a dead letter with that reason. Garbage bytes and schema-invalid JSON put straight on a model topic go to
``llm.dlq`` with their reasons while the consumer moves on and commits past them. ``sluicegate dlq list`` shows
the entries and ``sluicegate dlq replay`` republishes what can be served again.

Each test prints a ``FAULT-REPORT`` line (run with ``-s``) with the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import TopicPartition

from schemas import (
    STREAM_FIELD,
    DeadLetter,
    ErrorEvent,
    InferenceRequest,
    Names,
    RequestRecord,
    SamplingOptions,
    batch_request_id,
    utcnow,
)
from schemas.names import HEADER_REASON, HEADER_REQUEST_ID
from sluicegate.dead_letter_admin import read_topic
from sluicegate.kafka import create_admin, create_producer

from .conftest import MODEL_NAME, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


def report(name: str, **figures: Any) -> None:
    print(f"\nFAULT-REPORT {json.dumps({'test': name, **figures})}")


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"SLUICEGATE_SERVED_MODELS": MODEL_NAME, "OMP_NUM_THREADS": "1"}


def request(deadline_s: float | None = None, max_tokens: int = 6) -> InferenceRequest:
    now = utcnow()
    return InferenceRequest(
        request_id=uuid.uuid4().hex,
        model=MODEL_NAME,
        prompt="Hello there",
        sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        deadline=None if deadline_s is None else now + timedelta(seconds=deadline_s),
        created_at=now,
    )


def produce(pipeline: Pipeline, topic: str, *values: bytes, partition: int | None = None) -> list[int]:
    """Records straight onto ``topic`` (as a Kafka-native producer would); returns their offsets."""

    async def send() -> list[int]:
        producer = create_producer(bootstrap=pipeline.kafka_bootstrap)
        await producer.start()
        try:
            offsets = []
            for value in values:
                headers = []
                try:
                    headers = [(HEADER_REQUEST_ID, json.loads(value)["request_id"].encode())]
                except (ValueError, KeyError, TypeError):
                    pass
                meta = await producer.send_and_wait(topic, value, partition=partition, headers=headers)
                offsets.append(meta.offset)
            return offsets
        finally:
            await producer.stop()

    return asyncio.run(send())


def dead_letters(pipeline: Pipeline) -> list[tuple[dict[str, str], DeadLetter]]:
    records = asyncio.run(read_topic(pipeline.kafka_bootstrap, Names(pipeline.prefix).dlq_topic))
    return [
        ({k: v.decode() for k, v in r.headers or ()}, DeadLetter.model_validate_json(r.value))
        for r in records
        if r.value and r.value.startswith(b"{")
    ]


def letter_for(pipeline: Pipeline, request_id: str, timeout_s: float = 20) -> tuple[dict[str, str], DeadLetter]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for headers, letter in dead_letters(pipeline):
            if letter.request_id == request_id:
                return headers, letter
        time.sleep(0.2)
    raise AssertionError(f"no dead letter for {request_id}")


def topic(pipeline: Pipeline) -> str:
    return Names(pipeline.prefix).request_topic(MODEL_NAME, "standard")


def assert_deadline_exceeded(pipeline: Pipeline, request_id: str) -> None:
    events = pipeline.wait_stream_end(request_id, timeout_s=60)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
    assert events[0].code == "deadline_exceeded"
    headers, letter = letter_for(pipeline, request_id)
    assert headers[HEADER_REASON] == letter.reason == "deadline_exceeded"
    assert letter.source_topic == topic(pipeline) and letter.source_offset is not None
    assert InferenceRequest.model_validate_json(letter.payload).request_id == request_id


def test_expired_requests_are_not_run_and_are_dead_lettered(pipeline: Pipeline) -> None:
    # A deadline already past when a running worker reads it.
    past = request(deadline_s=-1)
    produce(pipeline, topic(pipeline), past.model_dump_json().encode())
    assert_deadline_exceeded(pipeline, past.request_id)

    # Deadlines that pass while no worker runs: one straight on Kafka, one through ingress (relative seconds),
    # and a request without a deadline queued alongside them, which is served.
    for service in list(pipeline.services):
        if service.name.startswith("worker") and service.alive():
            pipeline.kill(service, signal.SIGTERM)
    short = request(deadline_s=1.0)
    produce(pipeline, topic(pipeline), short.model_dump_json().encode())
    via_ingress = pipeline.submit(prompt="Hello there", max_tokens=6, temperature=0, deadline=1.0)["request_id"]
    undated = pipeline.submit(prompt="Hello there", max_tokens=6, temperature=0, ignore_eos=True)["request_id"]
    time.sleep(1.2)
    pipeline.start_worker("worker-b")
    done = pipeline.wait_stream_end(undated, timeout_s=90)
    assert done[-1].type == "done" and done[-1].usage.completion_tokens == 6
    for rid in (short.request_id, via_ingress):
        assert_deadline_exceeded(pipeline, rid)
        record = pipeline.record(rid)
        assert record is None or record.status == "failed"
    # Ingress's request has a status record: it says why it failed, for a client that missed the stream.
    failed = pipeline.record(via_ingress)
    assert failed is not None and failed.result is not None, failed
    assert (failed.result.error_code, failed.result.finish_reason) == ("deadline_exceeded", "error")
    report("deadlines", expired=3, run=0, dead_lettered=3, served_alongside=1)


def test_poison_messages_go_to_the_dlq_and_the_consumer_moves_on(pipeline: Pipeline) -> None:
    garbage = b"\xff\xfe\x00 not json at all \x9c"
    invalid = json.dumps({"request_id": f"bad-{uuid.uuid4().hex[:8]}", "model": MODEL_NAME, "prompt": 42}).encode()
    valid = request()
    offsets = produce(pipeline, topic(pipeline), garbage, invalid, valid.model_dump_json().encode(), partition=0)
    events = pipeline.wait_stream_end(valid.request_id, timeout_s=60)
    assert events[-1].type == "done" and events[-1].usage.completion_tokens == 6

    letters = {
        letter.source_offset: (headers, letter)
        for headers, letter in dead_letters(pipeline)
        if letter.source_topic == topic(pipeline) and letter.source_partition == 0
    }
    g_headers, g_letter = letters[offsets[0]]
    assert g_headers[HEADER_REASON] == g_letter.reason == "invalid_json"
    assert g_letter.payload == garbage.decode("utf-8", errors="replace")
    i_headers, i_letter = letters[offsets[1]]
    assert i_headers[HEADER_REASON] == i_letter.reason == "schema_violation:prompt"
    assert i_letter.request_id == json.loads(invalid)["request_id"] and "prompt" in i_letter.detail
    assert offsets[2] not in letters

    # The group's committed offset moved past all three.
    group = Names(pipeline.prefix).worker_group(MODEL_NAME)

    async def committed() -> int:
        admin = create_admin(bootstrap=pipeline.kafka_bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(group)
        finally:
            await admin.close()
        meta = offsets.get(TopicPartition(topic(pipeline), 0))
        return -1 if meta is None else meta.offset

    deadline = time.monotonic() + 15
    while (position := asyncio.run(committed())) <= offsets[2]:
        assert time.monotonic() < deadline, f"committed {position}, expected > {offsets[2]}"
        time.sleep(0.2)
    report("poison", garbage=1, schema_invalid=1, dead_lettered=2, valid_served=1, committed_offset=position)


def cli(pipeline: Pipeline, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "dlq", *args],
        env=pipeline.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dlq_cli_lists_and_replays(pipeline: Pipeline) -> None:
    names = Names(pipeline.prefix)
    listing = cli(pipeline, "list")
    for reason in ("reason=invalid_json", "reason=schema_violation:prompt", "reason=deadline_exceeded"):
        assert reason in listing
    assert f"source={topic(pipeline)}[0]@" in listing
    assert len(cli(pipeline, "list", "--limit", "1").splitlines()) == 1

    # Two servable letters, as a worker leaves them after a processing failure: one whose request never
    # wrote to its stream, and one whose stream ended with an error event.
    fresh, failed = request(), request()
    redis = pipeline.redis()
    error = ErrorEvent(request_id=failed.request_id, seq=0, code="internal_error", message="boom")
    redis.xadd(names.stream_key(failed.request_id), {STREAM_FIELD: error.model_dump_json()}, id="0-1")
    record = RequestRecord(
        request_id=failed.request_id,
        model=MODEL_NAME,
        tenant="default",
        priority="standard",
        status="failed",
        created_at=failed.created_at,
    )
    redis.set(names.request_key(failed.request_id), record.model_dump_json(), ex=600)
    # A line of a batch that has ended: its output files are written, so a replay would run it for nothing.
    ended_batch = f"batch_{uuid.uuid4().hex[:24]}"
    redis.hset(names.batch_key(ended_batch), "status", "completed")
    ended_line = request().model_copy(update={"request_id": batch_request_id(ended_batch, 4)})
    letters = [
        DeadLetter(
            reason="processing_failed",
            detail="synthetic",
            source_topic=topic(pipeline),
            payload=r.model_dump_json(),
            request_id=r.request_id,
        )
        for r in (fresh, failed, ended_line)
    ]
    produce(pipeline, names.dlq_topic, *(letter.model_dump_json().encode() for letter in letters))

    dry = cli(pipeline, "replay", "--dry-run")
    lines = dry.splitlines()
    assert any("would replay" in line and fresh.request_id in line for line in lines)
    assert any("would replay" in line and failed.request_id in line for line in lines)
    assert any(line.startswith("skipped") and "payload is still invalid" in line for line in lines)
    assert any(line.startswith("skipped") and "deadline" in line and "has passed" in line for line in lines)
    assert any(line.startswith("skipped") and ended_line.request_id in line and "has ended" in line for line in lines)
    time.sleep(1)
    assert pipeline.stream_events(fresh.request_id) == []
    assert len(pipeline.stream_events(failed.request_id)) == 1  # a dry run changes nothing

    replayed = cli(pipeline, "replay", "--reason", "processing_failed")
    assert replayed.count("replayed") >= 2, replayed
    for rid in (fresh.request_id, failed.request_id):
        events = pipeline.wait_stream_end(rid, timeout_s=60)
        assert [e.type for e in events].count("done") == 1 and events[-1].type == "done", events
        assert [e.seq for e in events] == list(range(len(events)))
    again = cli(pipeline, "replay", "--request-id", fresh.request_id).splitlines()
    assert any(line.startswith("skipped") and "already finished" in line for line in again)
    assert not any(line.startswith("replayed") for line in again)
    invalid_only = cli(pipeline, "replay", "--reason", "invalid_json").splitlines()
    assert invalid_only and all(line.startswith("skipped") for line in invalid_only[:-1])
    report("dlq_cli", listed=len(listing.splitlines()), replayed=2, skipped_invalid=True, listing=listing.splitlines())
