"""The batch benchmark runs end to end at tiny sizes (a 20-line batch, short phases) and prints its table, on the
test Kafka and Redis, with a real Celery batch worker."""

from __future__ import annotations

import pytest
from benchmark_support import run_benchmark

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_batch_benchmark_smoke(kafka_bootstrap: str, redis_url: str) -> None:
    argv = ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url, "--lines", "20", "--rate", "2"]
    argv += ["--baseline", "2", "--warmup", "0", "--batch-timeout", "120"]
    result = run_benchmark("batch", argv, timeout_s=280)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    out = result.stdout
    assert "status completed; 20 completed, 0 failed" in out, out
    header = "| interactive phase | requests | errors | TTFT p50 ms | TTFT p99 ms | engine p50 ms | engine p99 ms |"
    assert header in out, out
    before = next(line for line in out.splitlines() if line.startswith("| without batch (before) |"))
    cells = [cell.strip() for cell in before.strip("|").split("|")]
    assert cells[2] == "0" and "n/a" not in cells[3:], before  # no errors; client and engine TTFTs measured
    assert "| with batch |" in out, out
    assert "TTFT p99 with batch / without:" in out, out
    assert "ETA error (eta_seconds seen once 10% of the lines were done" in out, out
