"""The nemesis's faults against single workers, and the network that lets it cut one worker off.

A TCP proxy cannot isolate one process: Kafka clients reconnect to the addresses the brokers advertise. So each
worker runs in a network namespace of its own, joined by a veth pair to a bridge in the host's namespace. The
bridge holds two addresses: Kafka's brokers bind and advertise the first (``SLUICEGATE_KAFKA_HOST``), Redis and its
Sentinels the second; every other process (ingress, router, relays, this harness) stays in the host's namespace and
reaches both directly. A partition is a ``blackhole`` route for one of the two addresses inside one worker's
namespace: its packets to that side are dropped (established connections hang until their timeouts, new ones
fail), while the rest of the cluster and the other side stay reachable. Every worker's address is its own, so a
Redis command log names the worker that sent each command.

Faults (:class:`Fault`): ``kill`` (``SIGKILL`` of the worker's whole process group, then a fresh start),
``pause`` (``SIGSTOP`` of the group for longer than the group's session timeout, then ``SIGCONT``),
``partition_kafka`` and ``partition_redis`` (the route for the given time, then removed). :func:`schedule` spaces
them over a run, one worker at a time. Needs root and ``ip`` (iproute2); :meth:`WorkerNetwork.close` removes the
namespaces and the bridge (also after a failed start).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

FaultKind = Literal["kill", "pause", "partition_kafka", "partition_redis"]
# A killed worker takes longest to be back (a new process loads its engine), so a short run ends its turn with it.
FAULT_KINDS: tuple[FaultKind, ...] = ("pause", "partition_kafka", "partition_redis", "kill")


def can_isolate() -> bool:
    """Root with ``ip`` (iproute2): what a per-worker network namespace needs."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")


@dataclass(frozen=True)
class Fault:
    """One fault: at ``at_s`` seconds into the run, ``kind`` against ``worker`` for ``hold_s`` seconds (a kill's
    ``hold_s`` is how long the worker stays dead before it starts again)."""

    at_s: float
    kind: FaultKind
    worker: str
    hold_s: float


def schedule(
    duration_s: float, workers: Sequence[str], spacing_s: float, holds: Mapping[FaultKind, float], first_s: float = 0.0
) -> list[Fault]:
    """Faults every ``spacing_s`` from ``first_s`` until ``duration_s``: the kinds in turn, the workers in turn (so
    the same worker is not hit twice running), each held as ``holds`` says. A fault must end well before the next
    begins: ``spacing_s`` is checked against the longest hold."""
    if spacing_s <= max(holds.values()):
        raise ValueError(f"spacing {spacing_s}s must exceed the longest hold ({max(holds.values())}s)")
    faults, at, n = [], first_s, 0
    while at + max(holds.values()) < duration_s:
        kind = FAULT_KINDS[n % len(FAULT_KINDS)]
        faults.append(Fault(at, kind, workers[n % len(workers)], holds[kind]))
        at += spacing_s
        n += 1
    return faults


@dataclass
class WorkerNetwork:
    """The bridge and one namespace per worker, under a short random tag so parallel runs never meet."""

    subnet: str = "10.241.0"  # the /24's first three octets
    tag: str = field(default_factory=lambda: "sgn" + secrets.token_hex(2))
    addresses: dict[str, str] = field(default_factory=dict)  # worker -> its address
    namespaces: dict[str, str] = field(default_factory=dict)  # worker -> its namespace
    _bridge_up: bool = False

    @property
    def kafka_host(self) -> str:
        return f"{self.subnet}.1"

    @property
    def redis_host(self) -> str:
        return f"{self.subnet}.2"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def up(self) -> None:
        """The bridge with Kafka's and Redis's addresses (before anything binds them)."""
        _ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_up = True
        for host in (self.kafka_host, self.redis_host):
            _ip("addr", "add", f"{host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_worker(self, worker: str) -> str:
        """A namespace for ``worker`` with an address of its own on the bridge; returns that address."""
        index = len(self.namespaces)
        namespace, outside, inside = f"{self.tag}-w{index}", f"{self.tag}{index}h", f"{self.tag}{index}n"
        address = f"{self.subnet}.{10 + index}"
        _ip("netns", "add", namespace)
        self.namespaces[worker] = namespace
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")  # the engine's own process talks to the worker locally
        self.addresses[worker] = address
        return address

    def spawn(self, worker: str, command: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        """``command`` inside ``worker``'s namespace, in a session (and process group) of its own."""
        with log.open("ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[worker], *command],
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _route(self, action: str, worker: str, target: Literal["kafka", "redis"]) -> None:
        host = self.kafka_host if target == "kafka" else self.redis_host
        _ip("-n", self.namespaces[worker], "route", action, "blackhole", f"{host}/32")

    def partition(self, worker: str, target: Literal["kafka", "redis"]) -> None:
        """Cut ``worker`` off from Kafka or from Redis (every broker, or Redis and its Sentinels)."""
        self._route("add", worker, target)

    def heal(self, worker: str, target: Literal["kafka", "redis"]) -> None:
        self._route("del", worker, target)

    def close(self) -> None:
        """Remove every namespace (its veth goes with it) and the bridge; what is already gone is skipped."""
        for namespace in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self.namespaces.clear()
        if self._bridge_up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            self._bridge_up = False


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """``sig`` to the process and every process it started (a worker's engine process too)."""
    if process.poll() is None:
        os.killpg(process.pid, sig)


def pause(process: subprocess.Popen[bytes], hold_s: float) -> None:
    """``SIGSTOP`` the worker's group for ``hold_s``, then ``SIGCONT`` (blocking: run it in a thread)."""
    signal_group(process, signal.SIGSTOP)
    try:
        time.sleep(hold_s)
    finally:
        signal_group(process, signal.SIGCONT)
