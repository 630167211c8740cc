"""The nemesis run, short: 3 brokers, a Sentinel-watched Redis and two workers each in its own network namespace,
mixed clients (OpenAI SSE, WebSocket with resume, native, Kafka-native, a batch) while one fault of each kind runs
against a worker (``kill -9``, ``SIGSTOP`` past the session timeout, cut off from Kafka, cut off from Redis); then
every stream and result is checked (``benchmarks/nemesis.py``, ``benchmarks/nemesis_check.py``).

Checked: nothing lost, nothing duplicated, every fault kind ran and every client kind was served. Whether streams
were written by one owner epoch at a time is asserted once stream entries carry their writer and epoch (fencing);
before that the run attributes entries from Redis's command log and prints how many streams mixed two writers.
Prints one ``NEMESIS`` line (run with ``-s``).
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
from needs import require
from ports import free_port_run

from benchmarks.nemesis import parser, run
from benchmarks.nemesis_faults import FAULT_KINDS, can_isolate
from benchmarks.redis_failover import have_binaries
from cli.backbone.devstack import DevStackError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(900)]


def test_a_short_nemesis_run_loses_and_duplicates_nothing() -> None:
    require(can_isolate(), "root with iproute2 (ip netns)", "the nemesis puts each worker in a network namespace")
    require(have_binaries(), "redis-server and redis-sentinel", "apt-get install redis-sentinel")
    require(shutil.which("redis-cli") is not None, "redis-cli", "apt-get install redis-tools")
    args = parser().parse_args(
        [
            "--minutes", "1.2",
            "--workers", "2",
            "--spacing", "16",
            "--pause-s", "8",
            "--partition-s", "8",
            "--kill-down-s", "1",
            "--interval-s", "3",
            "--max-tokens", "96",
            "--batch-every-s", "60",
            "--drain-s", "120",
            "--first-port", str(free_port_run(24)),
            "--subnet", f"10.242.{random.randrange(1, 250)}",
        ]
    )  # fmt: skip
    try:
        result = run(args)
    except DevStackError as exc:
        require(False, "a private 3-broker Kafka (the Kafka jars)", str(exc))
        raise
    print("NEMESIS", json.dumps({k: v for k, v in result.items() if k != "findings"}))
    findings = "\n".join(result["findings"])
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["gaps"] == 0, findings
    assert set(result["faults"]) == set(FAULT_KINDS), result["faults"]
    assert set(result["by_client"]) == {"openai_sse", "websocket", "native", "kafka_native", "batch"}
    if result["attribution"] == "fields":
        assert result["mixed"] == 0, findings
