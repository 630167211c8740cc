"""What a running stack costs while nobody sends anything: CPU per second of each of its processes.

Finds the processes of a running ``sluicegate up`` on this machine: every ``cli.main <role>`` (ingress,
result-service, worker, router, batch-worker, up itself), the engine's child (``process_main``), the Kafka broker and
``redis-server``. Reads each one's CPU time (``/proc/<pid>/stat``, all threads) at the start and the end of
``--seconds`` and prints milliseconds of CPU per second, one row per process, as a markdown table. Send nothing
to the stack meanwhile: the point is what its loops cost at rest.

    bash infra/local/run.sh up &   # wait for "Sluicegate is up"
    python -m benchmarks.idle_cpu [--seconds 60]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from benchmarks.common import markdown_table, process_cpu_seconds

_ROLE = re.compile(r"-m\s+cli\.main\s+([\w-]+)")


def classify(cmdline: str) -> str | None:
    """The stack process a command line belongs to (``worker``, ``kafka``, ``engine``...), or None."""
    if (role := _ROLE.search(cmdline)) is not None:
        return role.group(1)
    if "gpu_workers.engine.entrypoints.process_main" in cmdline:
        return "engine"
    if "kafka.Kafka" in cmdline:
        return "kafka"
    if cmdline.startswith(("redis-server", "/usr/bin/redis-server")):
        return "redis"
    return None


def stack_processes() -> dict[int, str]:
    """pid -> role of every stack process running now."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        role = classify(cmdline)
        if role is not None:
            found[int(entry.name)] = role
    return found


def measure(pids: dict[int, str], seconds: float) -> list[tuple[str, int, float]]:
    """(role, pid, ms of CPU per second) over ``seconds``, largest first; a process that exits meanwhile is left out."""
    start: dict[int, float] = {}
    for pid in pids:
        try:
            start[pid] = process_cpu_seconds(pid)
        except OSError:
            continue
    time.sleep(seconds)
    rows = []
    for pid, before in start.items():
        try:
            rows.append((pids[pid], pid, 1e3 * (process_cpu_seconds(pid) - before) / seconds))
        except OSError:
            continue
    return sorted(rows, key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window (default 60)")
    args = parser.parse_args(argv)
    pids = stack_processes()
    if not pids:
        print("no Sluicegate stack is running here: start one with `bash infra/local/run.sh up`", file=sys.stderr)
        return 1
    rows = measure(pids, args.seconds)
    print(f"idle CPU over {args.seconds:g} s, {len(rows)} processes")
    print(markdown_table(["process", "pid", "ms of CPU per second"], [(r, str(p), f"{ms:.1f}") for r, p, ms in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
