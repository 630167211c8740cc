"""What every benchmark shares: a free local port, nearest-rank percentiles and number formatting, markdown
tables, CPU time of a process, uvloop when installed, and a private Kafka + Redis started through the dev-stack
API (``cli.backbone.devstack``, the one place that starts them).

Only the standard library is imported at module level: ``engine_gpu.py`` and ``engine_cpu.py`` import this
module on a bare GPU image (torch and transformers, no aiokafka, redis or pydantic-settings), so the dev stack
is imported inside :func:`start_private_stack` only.
"""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cli.backbone.devstack import StackInfo
    from sluicegate.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port_run(count: int, within: range | None = None) -> int:
    """The first of ``count`` consecutive free ports (a multi-broker stack derives its ports from one), from
    ``within`` (by default the ports below the kernel's ephemeral range). Never ephemeral ports: any outgoing
    connection (the brokers' own, to each other) can take one of them between this check and the listener's bind,
    and the broker then dies at start."""
    ports = within if within is not None else range(10_000, ephemeral_ports()[0])
    if len(ports) <= count:
        raise RuntimeError(f"no room for {count} ports in {ports.start}-{ports.stop - 1}")
    for _ in range(200):
        base = random.randrange(ports.start, ports.stop - count)
        if all(bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no run of {count} free ports found in {ports.start}-{ports.stop - 1}")


def bindable(port: int) -> bool:
    """Whether nothing listens on (or holds) ``port`` on the loopback address now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def best_ms(call: Callable[[], object], rounds: int) -> float:
    """The fastest of ``rounds`` timed calls after one untimed warm-up call, in milliseconds."""
    call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def fmt(value: Any, digits: int = 1) -> str:
    """A figure for a table: floats with ``digits`` decimals and thousands separators, NaN as ``n/a``."""
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the header, the separator line, then one line per row (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of process ``pid``, all its threads (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_service(workdir: Path, name: str, args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``sluicegate <args>`` (``python -m cli.main``) in a session of its own, its output appended to
    ``<workdir>/<name>.log``."""
    with (workdir / f"{name}.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cli.main", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def use_uvloop() -> None:
    """Make uvloop the event loop policy when it is installed (the services run on it too)."""
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


@dataclass
class PrivateStack:
    """Kafka and/or Redis a benchmark brought up; ``close`` stops only what this run started."""

    info: StackInfo
    settings: Settings

    def close(self) -> None:
        from cli.backbone import devstack

        if self.info.started:
            devstack.down(self.settings, services=self.info.started)

    def __enter__(self) -> PrivateStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, for a report's header ("n/a" where the system has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def start_private_stack(
    kafka_port: int,
    redis_port: int,
    *,
    state_dir: Path | None = None,
    full_jit: bool = False,
    services: tuple[str, ...] = ("kafka", "redis"),
    secure: bool = False,
) -> PrivateStack:
    """Kafka and Redis (or only ``services``) on the given ports through the dev-stack API, reusing ones already
    running there. ``state_dir`` defaults to the repository's ``.sluicegate`` (its broker-jar cache);
    ``full_jit`` lifts the dev broker's C1-only JIT cap (latency runs, as a production broker compiles);
    ``secure``: the broker speaks SASL_SSL only (SCRAM-SHA-512) and Redis TLS only, with its ACL users."""
    from cli.backbone import devstack
    from sluicegate.settings import Settings

    settings = Settings(
        state_dir=state_dir or REPO_ROOT / ".sluicegate",
        kafka_port=kafka_port,
        redis_port=redis_port,
        kafka_full_jit=full_jit,
        kafka_local_security="sasl_ssl" if secure else "plaintext",
        redis_tls=secure,
    )
    return PrivateStack(devstack.up(settings, services=services), settings)
