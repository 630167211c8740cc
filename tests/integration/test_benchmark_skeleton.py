"""The request-path skeleton benchmark carries requests end to end (POST, Kafka, stream, WebSocket) on the test
Kafka and Redis at a tiny size, and prints its table with every request streamed."""

from __future__ import annotations

import pytest
from benchmark_support import run_benchmark

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def test_skeleton_benchmark_smoke(kafka_bootstrap: str, redis_url: str) -> None:
    argv = ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url, "--rates", "20", "--duration", "2"]
    argv += ["--warmup", "0", "--floor-messages", "20"]
    result = run_benchmark("skeleton_path", argv, timeout_s=220)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| 20 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    streamed, sent = cells[1].split("/")
    assert int(sent) > 10 and streamed == sent, row  # every request's first token and done reached the client
    # Latency, floor and the CPU of the three processes measured (Kafka's and Redis's only on a private stack).
    assert all("n/a" not in cell for cell in cells[2:9]), row
