"""Ports for the servers tests start (Redis, brokers, services): free now, below the kernel's ephemeral range,
never handed out twice by one process, and from a slice of their own on each pytest-xdist worker.

A port from ``bind(0)`` is an ephemeral one: between handing it out and the server binding it, any outgoing
connection (a Kafka or Redis client of the many processes under test) may take it as its local port, and the server
then fails with "address already in use" (seen in CI: ingress under ``up``). Two xdist workers drawing from one
range could also hand out the same port before either binds it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from benchmarks.common import bindable
from benchmarks.common import free_port_run as _free_port_run

#: Ports this process already handed out: two services given ports before either binds must not get the same one
#: (it happened: both workers of a test took one metrics port, and one ran unobserved).
_HANDED_OUT: set[int] = set()


def ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (and to ``bind(0)``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> range:
    """This process's ports: the half below the ephemeral range, sliced per xdist worker (``gw0``, ``gw1``...)."""
    low = ephemeral_low()
    start, stop = low // 2, low
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        size = (stop - start) // count
        start += int(worker[2:]) % count * size
        stop = start + size
    return range(start, stop)


def free_port(exclude: tuple[int, ...] = (), *, with_successor: bool = False) -> int:
    """A free port of :func:`port_range`, not in ``exclude``; ``with_successor`` also wants port + 1 free (a
    broker's controller port)."""
    ports = port_range()
    for _ in range(1000):
        port = random.randrange(ports.start, ports.stop - 1)
        taken = (port, port + 1) if with_successor else (port,)
        if any(p in _HANDED_OUT or p in exclude or not bindable(p) for p in taken):
            continue
        _HANDED_OUT.update(taken)
        return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports of :func:`port_range`, none handed out before (a multi-broker
    stack derives all its ports from one)."""
    for _ in range(100):
        base = _free_port_run(count, port_range())
        run = set(range(base, base + count))
        if not run & _HANDED_OUT:
            _HANDED_OUT.update(run)
            return base
    raise RuntimeError(f"no run of {count} ports in {port_range()} that was not handed out already")
