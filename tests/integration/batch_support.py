"""Helpers for the batch integration tests: a real Celery batch worker process (``sluicegate batch-worker``) for a
test's settings, a fake GPU worker that also writes each result to ``llm.results`` (as the real worker does), and
builders for batch input files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from ingress_support import MODEL, FakeWorker, eventually, reply_for
from redis.asyncio import Redis

from schemas import DoneEvent, FinalResult, InferenceRequest, TokenEvent, Usage
from sluicegate.kafka import create_producer, ensure_topics
from sluicegate.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def worker_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a batch worker process the same settings as the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        env[f"SLUICEGATE_{name.upper()}"] = json.dumps(value) if isinstance(value, dict | list) else str(value)
    env["PYTHONPATH"] = str(ROOT)
    return env


@contextlib.contextmanager
def batch_worker(settings: Settings, log_path: Path, *, beat: bool = True) -> Iterator[subprocess.Popen[bytes]]:
    """A ``sluicegate batch-worker`` process (Celery, solo pool, beat embedded) for ``settings``; stopped after."""
    args = [sys.executable, "-m", "cli.main", "batch-worker"] + ([] if beat else ["--no-beat"])
    with log_path.open("ab") as log:
        process = subprocess.Popen(args, env=worker_env(settings), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(process, log_path)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60.0) -> None:
    """Block until Celery logs the worker ready, so a test's clock (a batch window) starts with a live worker."""
    deadline = time.monotonic() + timeout_s
    while b" ready." not in log_path.read_bytes():
        if process.poll() is not None:
            raise RuntimeError(f"batch worker exited with {process.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch worker not ready within {timeout_s} s; see {log_path}")
        time.sleep(0.1)


class ResultsWorker(FakeWorker):
    """The fake worker, plus the final result on ``llm.results`` keyed by request id (as the GPU worker writes it).

    A request whose last user text contains ``HANG`` sends one token and waits for its cancel marker, then ends
    with ``abort`` (as a cancelled request does); one containing ``FAIL`` ends with an ``error`` event and a
    ``failed`` record and no result (as a request the engine refuses does).
    """

    def __init__(self, settings: Settings, redis: Redis) -> None:
        super().__init__(settings, redis)
        self.producer: AIOKafkaProducer | None = None

    async def __aenter__(self) -> ResultsWorker:
        await ensure_topics(
            self.settings.kafka_bootstrap, {self.names.results_topic: self.settings.topic_partitions}, 1
        )
        self.producer = create_producer(self.settings)
        await self.producer.start()
        await super().__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await super().__aexit__(*exc)
        assert self.producer is not None
        await self.producer.stop()

    async def _publish(self, request: InferenceRequest, text: str, reason: str, usage: Usage) -> None:
        assert self.producer is not None
        result = FinalResult(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            text=text,
            token_ids=[1],
            finish_reason=reason,  # type: ignore[arg-type]
            usage=usage,
            worker_id="fake",
            created_at=request.created_at,
        )
        await self.producer.send_and_wait(
            self.names.results_topic, result.model_dump_json().encode(), key=request.request_id.encode()
        )

    async def _answer(self, request: InferenceRequest) -> None:
        rid = request.request_id
        said = reply_for(request)
        text = "".join(said)
        if "HANG" in text:
            await self._append(request, TokenEvent(request_id=rid, seq=0, text=said[0], token_ids=[1]))
            await eventually(lambda: self.redis.exists(self.names.cancel_key(rid)), timeout_s=120)
            usage = Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
            await self._append(request, DoneEvent(request_id=rid, seq=1, finish_reason="abort", usage=usage))
            await self._publish(request, said[0], "abort", usage)
            return
        if "FAIL" in text:
            from schemas import ErrorEvent, RequestRecord

            await self._append(request, ErrorEvent(request_id=rid, seq=0, code="invalid_request", message="no good"))
            record = RequestRecord(
                request_id=rid,
                model=request.model,
                tenant=request.tenant,
                priority=request.priority,
                status="failed",
                created_at=request.created_at,
            )
            await self.redis.set(self.names.request_key(rid), record.model_dump_json(), ex=600)
            return
        await super()._answer(request)
        usage = Usage(prompt_tokens=7, completion_tokens=len(said), total_tokens=7 + len(said), cached_tokens=2)
        await self._publish(request, text, "stop", usage)


def chat_line(custom_id: str, text: str, *, model: str = MODEL, **extra: Any) -> dict[str, Any]:
    """One chat-completions batch line."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 50, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    """A JSONL file's bytes."""
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def wait_status(client: Any, batch_id: str, statuses: set[str], timeout_s: float = 60.0) -> Any:
    """Poll the batch (through the SDK) until its status is one of ``statuses``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert asyncio.get_running_loop().time() < deadline, f"batch stuck in {batch.status}: {batch}"
        await asyncio.sleep(0.2)
