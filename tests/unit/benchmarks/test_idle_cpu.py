"""benchmarks.idle_cpu: which processes belong to a stack, and the CPU a busy one is charged."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.idle_cpu import classify, measure


def test_stack_processes_are_told_apart_by_command_line() -> None:
    python = "/root/.pyenv/versions/3.11.7/bin/python3"
    assert classify(f"{python} -m cli.main worker") == "worker"
    assert classify(f"{python} -m cli.main result-service") == "result-service"
    assert classify(f"{python} -m gpu_workers.engine.entrypoints.process_main --fd 15") == "engine"
    assert classify("/usr/bin/java -Xmx512m -cp /x/libs/* kafka.Kafka /x/server.properties") == "kafka"
    assert classify("/usr/bin/redis-server 127.0.0.1:6379") == "redis"
    assert classify(f"{python} -m pytest -q") is None
    assert classify("redis-cli monitor") is None


def test_a_busy_process_is_charged_its_cpu_and_a_gone_one_is_left_out() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rows = measure({busy.pid: "busy", 2**22 + 7: "gone"}, 0.5)
    finally:
        busy.kill()
        busy.wait()
    assert [(role, pid) for role, pid, _ in rows] == [("busy", busy.pid)]
    assert rows[0][2] > 100  # ms of CPU per second: a spinning process takes most of a core
