"""The end-to-end pair of ``vs_llamacpp.py``: Sluicegate's whole stack (``sluicegate up``: ingress, Kafka, the
worker and its engine, Redis, the result service) against llama.cpp's own ``llama-server`` on the same GGUF, both
driven by the official ``openai`` SDK exactly alike: the benchmark's chat prompts one stream at a time, greedy,
``tokens`` tokens each past end-of-text. Each system runs as it would for a user: ``up`` gives its engine all cores
but one (the rest of the stack runs on that one; ``SLUICEGATE_TORCH_THREADS`` overrides it), the server gets
``-t``/``-tb`` of the benchmark's thread count and one slot. The peer runs before and after ours, so a box whose load
drifts shows it; each system's first stream is a warm-up and not counted.

Per system: decode tok/s after the first token (median over streams) and TTFT (median), as ``stack_cpu.py``
measures them. ``up`` starts on private ports with the repository's state dir (its model and compile caches), its
own Kafka and Redis, and is stopped with Ctrl-C's signal when done.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.common import REPO_ROOT, free_port, progress
from benchmarks.stack_cpu import Streams, stream_one

UP_TIMEOUT_S = 900.0  # a first start compiles the decode graphs (about 1.5 min on two cores) after Kafka and Redis


@dataclass
class E2EMeasure:
    system: str
    streams: int
    decode_tok_s_p50: float
    ttft_ms_p50: float

    def as_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "streams": self.streams,
            "decode_tok_s_p50": round(self.decode_tok_s_p50, 1),
            "ttft_ms_p50": round(self.ttft_ms_p50, 1),
        }


async def _drive(base_url: str, api_key: str, prompts: list[str], tokens: int, passes: int) -> Streams:
    from openai import AsyncOpenAI

    # llama-server closes idle keep-alive connections, and a request sent on one just closed fails with no response:
    # the SDK's own retry sends it again (nothing was answered, so nothing is counted twice).
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        await stream_one(client, model, tokens, Streams(), prompts[0])
        seen = Streams()
        for _ in range(passes):
            for prompt in prompts:
                await stream_one(client, model, tokens, seen, prompt)
        return seen
    finally:
        await client.close()


def measure(system: str, base_url: str, api_key: str, prompts: list[str], tokens: int, passes: int) -> E2EMeasure:
    seen = asyncio.run(_drive(base_url, api_key, prompts, tokens, passes))
    result = E2EMeasure(
        system, len(seen.ttft_s), statistics.median(seen.decode_tok_s), 1e3 * statistics.median(seen.ttft_s)
    )
    progress(f"  e2e {system}: decode {result.decode_tok_s_p50:.1f} tok/s p50, TTFT p50 {result.ttft_ms_p50:.0f} ms")
    return result


class UpStack:
    """``sluicegate up`` in a subprocess on private ports; ``base_url`` and ``api_key`` once it says it is up."""

    def __init__(self, log_path: Path) -> None:
        self.ingress_port = free_port()
        env = {
            **os.environ,
            "SLUICEGATE_INGRESS_PORT": str(self.ingress_port),
            "SLUICEGATE_RESULT_PORT": str(free_port()),
            "SLUICEGATE_KAFKA_PORT": str(free_port()),
            "SLUICEGATE_REDIS_PORT": str(free_port()),
            "SLUICEGATE_WORKER_METRICS_PORT": "0",
            "SLUICEGATE_ROUTER_METRICS_PORT": "0",
            "SLUICEGATE_BATCH_METRICS_PORT": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up"],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.api_key = self._wait_up(UP_TIMEOUT_S)
        self.base_url = f"http://127.0.0.1:{self.ingress_port}/v1"

    def _wait_up(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluicegate up exited with {self.process.returncode}; see {self.log_path}")
            text = self.log_path.read_text(errors="replace")
            if "Sluicegate is up" in text:
                key = re.search(r"sg-[A-Za-z0-9_-]+", text)
                if key is None:
                    raise RuntimeError(f"sluicegate up printed no API key; see {self.log_path}")
                return key.group(0)
            time.sleep(1.0)
        raise RuntimeError(f"sluicegate up not up in {timeout_s:.0f} s; see {self.log_path}")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


class PeerServer(Protocol):
    """What the pair needs of llama-server: its port while it runs, and a way to stop it."""

    port: int

    def close(self) -> None: ...


def run_pair(
    start_peer: Callable[[], PeerServer], log_dir: Path, threads_note: str, prompts: list[str], tokens: int, passes: int
) -> dict[str, Any]:
    """llama-server (``start_peer`` starts one), then ``up``, then llama-server again; the ratios use the peer's mean
    of its two runs. ``up``'s log goes to ``log_dir``."""

    def peer(label: str) -> E2EMeasure:
        progress(f"e2e: llama-server ({label}) ...")
        server = start_peer()
        try:
            url = f"http://127.0.0.1:{server.port}/v1"
            return measure(f"llama-server ({label})", url, "none", prompts, tokens, passes)
        finally:
            server.close()

    before = peer("before")
    progress("e2e: sluicegate up ...")
    started = time.perf_counter()
    stack = UpStack(log_dir / "up-e2e.log")
    up_s = time.perf_counter() - started
    try:
        ours = measure("sluicegate up", stack.base_url, stack.api_key, prompts, tokens, passes)
    finally:
        stack.close()
    after = peer("after")
    peer_decode = (before.decode_tok_s_p50 + after.decode_tok_s_p50) / 2
    peer_ttft = (before.ttft_ms_p50 + after.ttft_ms_p50) / 2
    return {
        "up_start_s": round(up_s, 1),
        "threads": threads_note,
        "runs": [m.as_json() for m in (before, ours, after)],
        "decode_vs_llama_server": round(ours.decode_tok_s_p50 / peer_decode, 3),
        "ttft_vs_llama_server": round(ours.ttft_ms_p50 / peer_ttft, 3),
    }
