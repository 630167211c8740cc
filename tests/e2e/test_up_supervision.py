"""``sluicegate up`` keeps its processes running: ``kill -9`` of the worker (its whole process group, as the
out-of-memory killer or a dead container would) mid-stream, and of the batch worker, and ``up`` restarts each with a
log line while the API and chat page stay up; the streamed request resumes on the restarted worker and ends
with every token, and a batch created after the batch worker's restart completes. Ctrl-C then stops it all.

``up`` runs on the session's Kafka and Redis (``--kafka-bootstrap``/``--redis-url``) on a paced random model
(so the stream is still running when its worker dies), under a topic prefix of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .batch_support import TERMINAL, chat_line, wait_until, write_jsonl
from .conftest import free_port

pytestmark = pytest.mark.slow

API_KEY = "sg-up-supervision"
MAX_TOKENS = 600


class Up:
    """A running ``sluicegate up`` and everything it printed."""

    def __init__(self, process: subprocess.Popen[str], ingress_url: str) -> None:
        self.process = process
        self.ingress_url = ingress_url
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.process.poll() is None, "\n".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s:.0f} s:\n" + "\n".join(self.lines))

    def child(self, subcommand: str) -> psutil.Process:
        """The live child process running ``sluicegate <subcommand>``."""
        for proc in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.Error):
                cmdline = proc.cmdline()
                if cmdline[-1:] == [subcommand] and "cli.main" in cmdline:
                    return proc
        raise AssertionError(f"no running {subcommand!r} child of up: " + "\n".join(self.lines))

    def openai(self) -> object:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.ingress_url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def up(
    kafka_bootstrap: str, redis_url: str, paced_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Up]:
    state = tmp_path_factory.mktemp("up-state")
    ingress_port, result_port = free_port(), free_port()
    env = {
        **os.environ,
        "SLUICEGATE_STATE_DIR": str(state),
        "SLUICEGATE_TOPIC_PREFIX": f"u{uuid.uuid4().hex[:8]}.",
        "SLUICEGATE_API_KEYS": API_KEY,
        "SLUICEGATE_INGRESS_PORT": str(ingress_port),
        "SLUICEGATE_RESULT_PORT": str(result_port),
        "SLUICEGATE_PUBLIC_STREAM_URL": f"ws://127.0.0.1:{result_port}",
        "SLUICEGATE_WORKER_METRICS_PORT": "0",
        "SLUICEGATE_ROUTER_METRICS_PORT": "0",
        "SLUICEGATE_BATCH_METRICS_PORT": "0",
        "SLUICEGATE_HEARTBEAT_INTERVAL_S": "0.5",
        "SLUICEGATE_KV_CACHE_GB": "0.05",
        # Supervision is under test, not the engine: no minute of compiling per worker start.
        "SLUICEGATE_COMPILE_CPU_DECODE": "false",
        "SLUICEGATE_FILES_URL": str(state / "files"),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "cli.main", "up", "--model", f"{paced_model_dir}=paced-up"]
    command += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    running = Up(process, f"http://127.0.0.1:{ingress_port}")
    try:
        running.wait_for(r"Sluicegate is up\.", timeout_s=180)
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _stream(client: object, received: list[str], finish: list[str | None]) -> None:
    stream = client.chat.completions.create(  # type: ignore[attr-defined]
        model="paced-up",
        messages=[{"role": "user", "content": "keep going"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
            if chunk.choices[0].finish_reason:
                finish.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            finish.append(str(chunk.usage.completion_tokens))


def test_a_killed_worker_is_restarted_and_its_stream_resumes(up: Up) -> None:
    received: list[str] = []
    finish: list[str | None] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _stream(up.openai(), received, finish)
        except BaseException as exc:  # reported below
            errors.append(exc)

    reader = threading.Thread(target=run)
    reader.start()
    deadline = time.monotonic() + 60
    while len(received) < 20:
        assert time.monotonic() < deadline and not errors, (errors, up.lines)
        time.sleep(0.05)
    worker = up.child("worker")
    os.killpg(worker.pid, signal.SIGKILL)  # the worker and its engine process, as a dead container
    up.wait_for(r"^worker exited with code -9; restarting in 1 s", timeout_s=30)
    restarted = up.wait_for(r"^worker restarted \(pid (\d+), restart 1\)", timeout_s=30)
    assert int(restarted.group(1)) != worker.pid
    reader.join(timeout=240)
    assert not reader.is_alive() and not errors, (errors, up.lines[-20:])
    # The stream resumed on the restarted worker: it ended normally with every token asked for.
    assert finish == ["length", str(MAX_TOKENS)], finish
    assert up.process.poll() is None  # the API and the chat page stayed up throughout


def test_a_killed_batch_worker_is_restarted_and_batches_complete(up: Up, tmp_path: Path) -> None:
    batch_worker = up.child("batch-worker")
    os.killpg(batch_worker.pid, signal.SIGKILL)
    up.wait_for(r"^batch-worker exited with code -9; restarting in 1 s", timeout_s=30)
    up.wait_for(r"^batch-worker restarted \(pid \d+, restart 1\)", timeout_s=30)
    client = up.openai()
    path = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"q{n}", "paced-up", max_tokens=4) for n in range(3)])
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")  # type: ignore[attr-defined]
    batch = client.batches.create(  # type: ignore[attr-defined]
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_until(client, batch.id, lambda b: b.status in TERMINAL, timeout_s=120)
    assert batch.status == "completed", json.dumps(batch.model_dump())
    assert batch.request_counts.completed == 3


def test_ctrl_c_stops_every_child(up: Up) -> None:
    children = psutil.Process(up.process.pid).children()
    assert len(children) == 5, children  # worker, ingress, result service, router, batch worker
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(timeout=60) == 0
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, alive
