"""Fencing with real worker processes: a worker paused (``SIGSTOP``) past its group session and resumed is fenced,
and each stream stays written by one owner epoch at a time.

Prints one ``FAULT-REPORT`` line per test (run with ``-s``) with the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from gpu_workers.worker.fencing import EPOCH_FIELD, WRITER_FIELD
from schemas import STREAM_FIELD, DoneEvent, Names, parse_stream_event
from sluicegate.kafka import create_consumer

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

SESSION_MS = 3000  # short, so that a pause outlives it soon; the shared broker allows down to 1 s
PROMPTS = ["Paused at dawn", "A river in the hills", "The harbour at night", "Bells over the valley"]


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Generation lasts long enough for the pause and the join to fall mid-stream."""
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "SLUICEGATE_WORKER_SESSION_TIMEOUT_MS": str(SESSION_MS)}


def entries(pipeline: Pipeline, request_id: str) -> list[tuple[int, str, int, str]]:
    """(seq, type, epoch, writer) of every entry of the request's stream."""
    raw = pipeline.redis().xrange(Names(pipeline.prefix).stream_key(request_id))
    out = []
    for _, fields in raw:
        event = parse_stream_event(fields[STREAM_FIELD.encode()])
        out.append((event.seq, event.type, int(fields[EPOCH_FIELD.encode()]), fields[WRITER_FIELD.encode()].decode()))
    return out


def audit(pipeline: Pipeline, request_id: str, max_tokens: int) -> list[tuple[int, str, int, str]]:
    """The stream once ended: seq 0..n once, one ``done`` and last, ``max_tokens`` tokens, and one writer per epoch
    with epochs that never go back (no entry of an older owner after a newer one's)."""
    pipeline.wait_stream_end(request_id, timeout_s=180)
    found = entries(pipeline, request_id)
    assert [seq for seq, _, _, _ in found] == list(range(len(found))), f"{request_id}: gap or duplicate"
    assert [kind for _, kind, _, _ in found].count("done") == 1 and found[-1][1] == "done"
    done = pipeline.stream_events(request_id)[-1]
    assert isinstance(done, DoneEvent) and done.usage.completion_tokens == max_tokens
    epochs = [epoch for _, _, epoch, _ in found]
    assert epochs == sorted(epochs), f"{request_id}: an older owner wrote after a newer one: {epochs}"
    writers: dict[int, set[str]] = {}
    for _, _, epoch, writer in found:
        writers.setdefault(epoch, set()).add(writer)
    assert all(len(w) == 1 for w in writers.values()), f"{request_id}: two writers in one epoch: {writers}"
    return found


def wait_owners(pipeline: Pipeline, request_ids: list[str], by_record: bool = False) -> dict[str, str]:
    """request id -> the worker serving it (the writer of its last entry, or ``by_record`` the worker its status
    record names), once every request has streamed a few events."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        owners = {}
        for rid in request_ids:
            found = entries(pipeline, rid)
            record = pipeline.record(rid) if by_record else None
            if len(found) >= 3 and (record.worker_id if record is not None else found[-1][3]):
                owners[rid] = str(record.worker_id) if record is not None else found[-1][3]
        if len(owners) == len(request_ids):
            return owners
        time.sleep(0.05)
    raise AssertionError("not every request started")


def records_per_request(pipeline: Pipeline, topic: str, request_ids: list[str]) -> list[int]:
    """How many records each request has on ``topic`` (keyed by request id), read from the start."""

    async def read() -> Counter[str]:
        consumer = create_consumer(topic, group_id=None, bootstrap=pipeline.kafka_bootstrap)
        await consumer.start()
        counts: Counter[str] = Counter()
        try:
            while batch := await consumer.getmany(timeout_ms=2000):
                counts.update(r.key.decode() for records in batch.values() for r in records if r.key)
        finally:
            await consumer.stop()
        return counts

    counts = asyncio.run(read())
    return [counts[rid] for rid in request_ids]


def test_a_worker_paused_past_its_session_is_fenced_when_it_resumes(pipeline: Pipeline) -> None:
    max_tokens = 300
    extra = pipeline.start_worker("worker-b")
    pipeline.wait_workers(2)
    submitted = [
        pipeline.submit(prompt=p, max_tokens=max_tokens, temperature=1.0, seed=7 + i, ignore_eos=True)["request_id"]
        for i, p in enumerate(PROMPTS * 2)
    ]
    owners = wait_owners(pipeline, submitted)
    victim_id = max(set(owners.values()), key=list(owners.values()).count)
    victim = pipeline.find(victim_id)
    victims = [rid for rid, owner in owners.items() if owner == victim_id]
    victim.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # The other worker takes the partitions over once the session lapses, and resumes the victim's requests
        # (each pick-up raises the request's epoch).
        deadline = time.monotonic() + 60
        while not all(entries(pipeline, rid)[-1][3] != victim_id for rid in victims if not _ended(pipeline, rid)):
            assert time.monotonic() < deadline, "nobody took the paused worker's requests over"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        paused_s = time.monotonic() - stopped
        victim.process.send_signal(signal.SIGCONT)
    streams = {rid: audit(pipeline, rid, max_tokens) for rid in submitted}
    taken_over = sum(len({w for _, _, _, w in found}) > 1 for found in streams.values())
    # The resumed worker's buffered and next writes were refused: it says so once per request it had.
    names = Names(pipeline.prefix)
    for rid in submitted:
        pipeline.wait_record(rid, "finished", timeout_s=30)  # written after the result and usage records
    # What a fenced worker does not publish: a result or usage record of a request it lost. Each request has one of
    # each unless an owner ended it (``done``) and lost it before its status record (the at-least-once window).
    results = records_per_request(pipeline, names.results_topic, submitted)
    usage = records_per_request(pipeline, names.usage_topic, submitted)
    fenced_lines = victim.log_path.read_text(errors="replace").count("msg=worker.fenced")
    retaken = victim.log_path.read_text(errors="replace").count("msg=worker.retaking_fenced")
    print(
        "\nFAULT-REPORT "
        + json.dumps(
            {
                "test": "worker_sigstop_past_session",
                "requests": len(submitted),
                "tokens_each": max_tokens,
                "victim_requests": len(victims),
                "paused_s": round(paused_s, 2),
                "taken_over": taken_over,
                "fenced_log_lines": fenced_lines,
                "retaken_by_victim": retaken,
                "max_epoch": max(e for found in streams.values() for _, _, e, _ in found),
                "results_records": sum(results),
                "usage_records": sum(usage),
                "lost": 0,
                "duplicated": 0,
                "mixed": 0,
            }
        )
    )
    assert taken_over >= 1 and fenced_lines >= 1
    assert min(results) >= 1 and min(usage) >= 1
    pipeline.kill(extra, signal.SIGTERM)


def _ended(pipeline: Pipeline, request_id: str) -> bool:
    found = entries(pipeline, request_id)
    return bool(found) and found[-1][1] in ("done", "error")
