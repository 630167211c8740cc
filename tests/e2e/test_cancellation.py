"""Cancellation on the real pipeline, by every route a client has: ``DELETE /v1/requests/{id}`` (ingress), a
``{"type": "cancel"}`` message on the WebSocket (result service), and a client that drops an OpenAI
streaming response (ingress). Each reaches the worker over ``llm.control``; the engine aborts the sequence,
its KV blocks are freed (seen in the worker's heartbeat), and the stream ends with ``done`` / ``abort``.
A request cancelled while still queued in Kafka is never run.

Each test prints a ``FAULT-REPORT`` line (run with ``-s``) with the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from schemas import DoneEvent, TokenEvent, WorkerHeartbeat

from .conftest import MODEL_NAME, Pipeline, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = "The quick brown fox"
LONG = 1500  # tokens: far more than a test waits for, so only a cancel ends these requests early


def report(name: str, **figures: Any) -> None:
    print(f"\nFAULT-REPORT {json.dumps({'test': name, **figures})}")


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    # Ingress accepts the model while no worker runs (the queued-cancel test stops them all).
    # A short reader lease: a killed ingress's requests are stopped within seconds.
    return {"SLUICEGATE_SERVED_MODELS": MODEL_NAME, "OMP_NUM_THREADS": "1", "SLUICEGATE_READER_LEASE_S": "1.5"}


def wait_tokens(pipeline: Pipeline, request_id: str, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(isinstance(e, TokenEvent) for e in pipeline.stream_events(request_id)) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{request_id} produced fewer than {count} tokens")


def assert_aborted(pipeline: Pipeline, request_id: str, timeout_s: float = 15) -> tuple[list[Any], float]:
    """The stream ends with done/abort, complete and accounted; returns its events and how long it took."""
    started = time.monotonic()
    events = pipeline.wait_stream_end(request_id, timeout_s)
    took = time.monotonic() - started
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort", done
    assert [e.seq for e in events] == list(range(len(events)))
    tokens = sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent))
    assert done.usage.completion_tokens == tokens < LONG
    # The status record is written just after ``done`` (with the final result).
    deadline = time.monotonic() + 5
    while (record := pipeline.record(request_id)) is None or record.status != "cancelled":
        assert time.monotonic() < deadline, record
        time.sleep(0.02)
    return events, took


def wait_heartbeat(
    pipeline: Pipeline, worker_id: str, check: Callable[[WorkerHeartbeat], bool], timeout_s: float = 10
) -> WorkerHeartbeat:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = pipeline.heartbeats().get(worker_id)
        if beat is not None and check(beat):
            return beat
        time.sleep(0.05)
    raise AssertionError(f"no such heartbeat from {worker_id}: {pipeline.heartbeats().get(worker_id)}")


def wait_engine_idle(pipeline: Pipeline, worker_id: str, after: float, timeout_s: float = 10) -> float:
    """Until the worker's heartbeat (sent after ``after``) shows nothing running and every KV block free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = pipeline.heartbeats().get(worker_id)
        if (
            beat is not None
            and beat.sent_at.timestamp() > after
            and beat.running == 0
            and beat.waiting == 0
            and beat.free_kv_blocks == beat.total_kv_blocks
        ):
            return beat.sent_at.timestamp() - after
        time.sleep(0.05)
    raise AssertionError(f"{worker_id} still holds the request: {pipeline.heartbeats().get(worker_id)}")


def test_delete_aborts_a_running_request_and_frees_its_kv_blocks(pipeline: Pipeline) -> None:
    rid = pipeline.submit(prompt=PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True)["request_id"]
    wait_tokens(pipeline, rid, 10)
    owner = pipeline.record(rid).worker_id
    busy = wait_heartbeat(pipeline, owner, lambda b: b.running == 1 and b.free_kv_blocks < b.total_kv_blocks)
    before = len(pipeline.stream_events(rid))
    cancelled_at, started = time.time(), time.monotonic()
    response = httpx.delete(f"{pipeline.ingress_url}/v1/requests/{rid}", headers=pipeline.headers(), timeout=30)
    assert response.status_code == 202, response.text
    events, _ = assert_aborted(pipeline, rid)
    took = time.monotonic() - started
    freed_after = wait_engine_idle(pipeline, owner, cancelled_at)
    report(
        "cancel_delete",
        events_before_cancel=before,
        events_after_cancel=len(events) - before,
        done_after_delete_s=round(took, 3),
        kv_blocks_used_while_running=busy.total_kv_blocks - busy.free_kv_blocks,
        kv_free_in_heartbeat_after_s=round(freed_after, 2),
    )


async def test_websocket_cancel_message_aborts_the_request(pipeline: Pipeline) -> None:
    accepted = pipeline.submit(prompt=PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True)
    rid = accepted["request_id"]
    received: list[dict[str, Any]] = []
    sent_at: float | None = None
    async with connect(f"{accepted['stream_url']}?token={accepted['stream_token']}", open_timeout=10) as ws:
        async for message in ws:
            event = json.loads(message)
            received.append(event)
            if sent_at is None and event["type"] == "token" and event["seq"] >= 10:
                await ws.send(json.dumps({"type": "cancel"}))
                sent_at = time.monotonic()
            if event["type"] in ("done", "error"):
                break
    took = time.monotonic() - (sent_at or 0)
    assert received[-1]["type"] == "done" and received[-1]["finish_reason"] == "abort"
    assert [e["seq"] for e in received] == list(range(len(received)))
    events, _ = assert_aborted(pipeline, rid)
    assert len(events) == len(received)
    wait_engine_idle(pipeline, pipeline.record(rid).worker_id, time.time())
    report("cancel_websocket", events=len(received), done_after_s=round(took, 3))


def streamed_completion(
    pipeline: Pipeline, prompt: str | list[str], ingress_url: str | None = None
) -> AbstractContextManager[httpx.Response]:
    """A long streamed /v1/completions, read by hand so that leaving the block drops the connection mid-stream."""
    body = {
        "model": pipeline.model,
        "prompt": prompt,
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    url = f"{ingress_url or pipeline.ingress_url}/v1/completions"
    return httpx.stream("POST", url, json=body, headers=pipeline.headers(), timeout=60)


def read_chunks(response: httpx.Response, count: int) -> tuple[str, int]:
    """Read ``count`` SSE chunks of a streamed answer (200); returns its request id and the chunks read."""
    assert response.status_code == 200
    chunks = 0
    for line in response.iter_lines():
        chunks += line.startswith("data: ")
        if chunks >= count:
            break
    return response.headers["x-request-id"], chunks


def test_openai_client_disconnect_aborts_the_request(pipeline: Pipeline) -> None:
    with streamed_completion(pipeline, PROMPT) as response:
        rid, chunks = read_chunks(response, 10)
    # Leaving the block closed the connection mid-stream.
    left_at = time.monotonic()
    assert_aborted(pipeline, rid)
    took = time.monotonic() - left_at
    wait_engine_idle(pipeline, pipeline.record(rid).worker_id, time.time())
    report("cancel_client_disconnect", chunks_read=chunks, done_after_s=round(took, 3))


def test_an_openai_stream_whose_ingress_died_is_stopped_by_its_worker(pipeline: Pipeline) -> None:
    """An ingress killed mid-response cancels nothing, and its client cannot resume: the worker stops the request
    once that ingress's reader lease lapses (``SLUICEGATE_READER_LEASE_S``, 1.5 s in this module)."""
    port = free_port()
    second = pipeline.start("ingress-2", "ingress", extra_env={"SLUICEGATE_INGRESS_PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    pipeline.wait_http(f"{url}/healthz", second)
    with streamed_completion(pipeline, PROMPT, url) as response:
        rid, chunks = read_chunks(response, 10)
        pipeline.kill(second)  # SIGKILL: no disconnect handling, no cancel, no lease given up
        killed_at = time.monotonic()
    assert_aborted(pipeline, rid)
    took = time.monotonic() - killed_at
    worker = pipeline.record(rid).worker_id
    wait_engine_idle(pipeline, worker, time.time())
    log = pipeline.find(worker).log_path.read_text(errors="replace").splitlines()
    assert any("worker.reader_gone" in line and rid in line for line in log)
    report("cancel_ingress_killed", chunks_read=chunks, done_after_s=round(took, 3))


def test_cancel_while_queued_in_kafka_is_honoured_at_pickup(pipeline: Pipeline) -> None:
    """Workers stopped (SIGTERM: drained), a request submitted and cancelled, then a worker started: it never
    runs the cancelled request, while the one queued behind it is served."""
    for service in list(pipeline.services):
        if service.name.startswith("worker") and service.alive():
            pipeline.kill(service, signal.SIGTERM)
    cancelled = pipeline.submit(prompt=PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True)["request_id"]
    served = pipeline.submit(prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True)["request_id"]
    response = httpx.delete(f"{pipeline.ingress_url}/v1/requests/{cancelled}", headers=pipeline.headers(), timeout=30)
    assert response.status_code == 202, response.text
    assert pipeline.stream_events(cancelled) == []
    pipeline.start_worker("worker-late")
    served_events = pipeline.wait_stream_end(served, timeout_s=90)
    assert served_events[-1].type == "done" and served_events[-1].finish_reason == "length"
    events = pipeline.wait_stream_end(cancelled, timeout_s=30)
    # Only ``done``: not one token was generated.
    assert len(events) == 1 and isinstance(events[0], DoneEvent)
    assert events[0].finish_reason == "abort" and events[0].usage.completion_tokens == 0
    log = pipeline.find("worker-late").log_path.read_text(errors="replace")
    assert any("worker.cancelled_before_start" in line and cancelled in line for line in log.splitlines())
    report("cancel_while_queued", stream_events=len(events), completion_tokens=0)


def test_a_client_leaving_a_list_of_prompts_aborts_every_prompt(pipeline: Pipeline) -> None:
    """A streamed /v1/completions of several prompts is several requests: the client leaving cancels them all."""
    with streamed_completion(pipeline, [PROMPT, PROMPT + " again"]) as response:
        assert response.status_code == 200
        rids = response.headers["x-request-ids"].split(",")
        assert len(rids) == 2 and rids[0] == response.headers["x-request-id"]
        indexes: set[int] = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                indexes.update(c["index"] for c in json.loads(line[6:])["choices"])
            if indexes == {0, 1}:
                break  # both prompts are generating: leaving the block closes the connection mid-stream
    for rid in rids:
        assert_aborted(pipeline, rid)
