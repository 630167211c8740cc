"""The local dev stack behind ``sluicegate dev up|status|down``: a single-node Kafka (KRaft, broker and
controller in one JVM, jars fetched from Maven Central) and a Redis server, run as background
processes whose pid files, data and logs live under ``Settings.state_dir`` (see ``layout.py``).

This module is THE place that starts and stops Kafka + Redis: ``sluicegate up``, the test session and the
benchmarks call :func:`up` / :func:`down` / :func:`status`. The jobs behind them live beside it: pid files
and processes (``processes.py``), Java and the broker jars (``jars.py``), the broker (``kafka_broker.py``)
and Redis (``redis_server.py``). ``python -m cli.backbone.devstack fetch|up|status|down`` is its script
entry (CI and ``infra/local/run.sh``). ``--kafka-security sasl_ssl`` (``kafka_local_security``) gives the
broker a SASL_SSL client listener instead of a plaintext one (``broker_security.py``); ``up`` then prints the
SLUICEGATE_KAFKA_* variables a service needs to reach it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

from cli.backbone.broker_security import check_security, local_client_security, security_env
from cli.backbone.jars import ensure_jars, find_java
from cli.backbone.kafka_broker import KAFKA_START_TIMEOUT_S, KAFKA_STOP_TIMEOUT_S, kafka_owner
from cli.backbone.kafka_cluster import (
    check_size,
    cluster_bootstrap,
    node_layouts,
    recorded_size,
    running_pids,
    start_nodes,
    wait_for_brokers,
)
from cli.backbone.redis_server import (
    REDIS_START_TIMEOUT_S,
    REDIS_STOP_TIMEOUT_S,
    find_redis_server,
    redis_owner,
    start_redis,
)
from cli.stack.layout import DevStackError, StackLayout
from cli.stack.processes import (
    Running,
    alive,
    last_problem,
    locked,
    log,
    port_in_use,
    run_coro,
    running_pid,
    stop,
)
from sluicegate.kafka import probe_kafka, wait_for_kafka
from sluicegate.kafka_security import KafkaAccessError
from sluicegate.redis_client import wait_for_redis
from sluicegate.redis_urls import mask_url
from sluicegate.settings import Settings, get_settings

SERVICES: tuple[str, ...] = ("kafka", "redis")

__all__ = ["DevStackError", "ServiceStatus", "StackInfo", "StackStatus", "down", "fetch_jars", "status", "up"]


# ----------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class StackInfo:
    """What ``up`` brought up: the addresses to use and the processes serving them (a pid is None for a
    service ``up`` was not asked for)."""

    kafka_bootstrap: str
    redis_url: str
    kafka_pid: int | None
    redis_pid: int | None
    state_dir: Path
    started: tuple[str, ...] = ()  # services this call started; the others were already running
    elapsed_s: float = 0.0
    kafka_pids: tuple[int, ...] = ()  # every node of a multi-broker stack (node 0 first)
    kafka_env: dict[str, str] = field(default_factory=dict)  # a SASL_SSL broker's SLUICEGATE_KAFKA_* variables

    def env(self) -> dict[str, str]:
        """Environment that points Sluicegate services at this stack."""
        env = {}
        if self.kafka_pid is not None:
            env["SLUICEGATE_KAFKA_BOOTSTRAP"] = self.kafka_bootstrap
            env |= self.kafka_env
        if self.redis_pid is not None:
            env["SLUICEGATE_REDIS_URL"] = self.redis_url
        return env

    def lines(self) -> list[str]:
        """Human-readable summary for the CLI."""

        def state(name: str) -> str:
            return "started" if name in self.started else "already running"

        services = []
        if self.kafka_pid is not None:
            pids = ", ".join(str(p) for p in self.kafka_pids) or str(self.kafka_pid)
            services.append(f"kafka  {self.kafka_bootstrap}  pid {pids} ({state('kafka')})")
        if self.redis_pid is not None:
            services.append(f"redis  {mask_url(self.redis_url)}  pid {self.redis_pid} ({state('redis')})")
        return [
            *services,
            f"state  {self.state_dir}  (ready in {self.elapsed_s:.1f}s)",
            *(f"export {key}={value}" for key, value in self.env().items()),
        ]


@dataclass(frozen=True)
class ServiceStatus:
    """One service of the stack: our process (if any) and whether its address answers."""

    name: str
    address: str
    pid: int | None
    answering: bool
    log_path: Path
    detail: str = ""

    @property
    def running(self) -> bool:
        return self.pid is not None

    def line(self) -> str:
        process = f"pid {self.pid}" if self.pid is not None else "not running"
        health = "answering" if self.answering else "not answering"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.name:<5}  {self.address}  {process}, {health}{extra}  log {self.log_path}"


@dataclass(frozen=True)
class StackStatus:
    """``status`` result: one entry per service."""

    kafka: ServiceStatus
    redis: ServiceStatus

    @property
    def services(self) -> tuple[ServiceStatus, ...]:
        return (self.kafka, self.redis)

    @property
    def healthy(self) -> bool:
        return all(s.running and s.answering for s in self.services)

    def lines(self) -> list[str]:
        return [s.line() for s in self.services]


# ----------------------------------------------------------------------------------------------------
# Public API


def _check_services(services: tuple[str, ...]) -> None:
    unknown = set(services) - set(SERVICES)
    if unknown:
        raise DevStackError(f"unknown services {sorted(unknown)}: expected kafka and/or redis")


def _busy_port_error(port: int, setting: str) -> DevStackError:
    return DevStackError(f"port {port} is in use by a process this stack did not start: stop it or set {setting}")


def fetch_jars(settings: Settings | None = None) -> Path:
    """Fetch the pinned Kafka broker jars into ``<state_dir>/kafka/libs/<version>`` unless cached;
    returns that folder. Needs Maven (and network) only the first time."""
    layout = StackLayout.of(settings or get_settings())
    with locked(layout.state):
        return ensure_jars(layout)


def up(settings: Settings | None = None, services: tuple[str, ...] = SERVICES) -> StackInfo:
    """Start Kafka and Redis unless they already run, wait until both answer, return their addresses.

    Idempotent: a live process (checked by pid file, command line and port) is reused; a stale pid
    file is removed. Raises ``DevStackError`` with a one-line reason when something is missing or a
    service will not start (the processes this call started are stopped again). ``services`` limits it
    to some of them (a benchmark that needs only Redis).
    """
    _check_services(services)
    settings = settings or get_settings()
    layout = StackLayout.of(settings)
    want_kafka, want_redis = "kafka" in services, "redis" in services
    started_at = time.monotonic()
    nodes = node_layouts(layout, settings.kafka_brokers)
    with locked(layout.state):
        redis_owns = redis_owner(layout)
        node_pids = running_pids(nodes) if want_kafka else []
        redis_pid = running_pid(layout.redis_pid, redis_owns) if want_redis else None
        # A node that is not running is started (also one node of a cluster whose others run: a restart).
        missing = [i for i, pid in enumerate(node_pids) if pid is None]
        start_kafka_now, start_redis_now = bool(missing), want_redis and redis_pid is None
        started: list[str] = []

        if want_kafka:  # a running broker of the other kind is not what was asked for either
            check_security(layout, settings.kafka_local_security)
        if start_kafka_now:
            check_size(layout, settings.kafka_brokers)
            for i in missing:
                for port in (nodes[i].kafka_port, nodes[i].kafka_port + 1):
                    if port_in_use(port):
                        raise _busy_port_error(port, "SLUICEGATE_KAFKA_PORT")
        if start_redis_now and port_in_use(layout.redis_port):
            raise _busy_port_error(layout.redis_port, "SLUICEGATE_REDIS_PORT")

        # Every tool is checked (and the jars fetched) before anything starts, so a missing one fails
        # fast with its own message and leaves nothing running.
        java, libs = (find_java(), ensure_jars(layout)) if start_kafka_now else ("", layout.libs_root)
        redis_server = find_redis_server() if start_redis_now else ""

        try:
            if start_redis_now:  # Redis first: it is ready long before the JVM, so nothing waits on it
                redis_pid = start_redis(layout, redis_server, settings.topic_prefix)
                started.append("redis")
            if start_kafka_now:
                for i, pid in start_nodes(nodes, settings, java, libs, missing).items():
                    node_pids[i] = pid
                started.append("kafka")
            kafka_pid = node_pids[0] if node_pids else None
            run_coro(_wait_ready(layout, kafka_pid, redis_pid, nodes if want_kafka else []))
        except BaseException:
            # Leave nothing half-started behind: a retry then starts from a clean slate.
            ours: dict[str, Running] = {}
            if "redis" in started and redis_pid is not None:
                ours["redis"] = Running(redis_pid, layout.redis_pid, redis_owns, REDIS_STOP_TIMEOUT_S)
            for i in missing if "kafka" in started else []:
                pid = node_pids[i]
                if pid is not None:
                    node = nodes[i]
                    ours[f"kafka-{i}"] = Running(pid, node.kafka_pid, kafka_owner(node), KAFKA_STOP_TIMEOUT_S)
            stop(ours)
            raise

    info = StackInfo(
        kafka_bootstrap=cluster_bootstrap(nodes) if want_kafka else layout.bootstrap,
        redis_url=layout.redis_url,
        kafka_pid=kafka_pid,
        redis_pid=redis_pid,
        state_dir=layout.state,
        started=tuple(started),
        elapsed_s=time.monotonic() - started_at,
        kafka_pids=tuple(p for p in node_pids if p is not None) if len(nodes) > 1 else (),
        kafka_env=security_env(layout, cluster_bootstrap(nodes)) if want_kafka else {},
    )
    log.info(
        "devstack.up bootstrap=%s redis_url=%s kafka_pid=%s redis_pid=%s started=%s elapsed_s=%.2f",
        info.kafka_bootstrap,
        mask_url(info.redis_url),
        kafka_pid,
        redis_pid,
        ",".join(started) or "none",
        info.elapsed_s,
    )
    return info


async def _wait_ready(
    layout: StackLayout, kafka_pid: int | None, redis_pid: int | None, nodes: list[StackLayout] | None = None
) -> None:
    """Until each service given a pid answers; a process that exits meanwhile fails at once with its log's reason."""
    nodes = nodes or [layout]

    def kafka_check() -> None:
        for node in nodes:
            pid = running_pid(node.kafka_pid, kafka_owner(node))
            if pid is None:
                raise DevStackError(
                    f"kafka exited during startup: {last_problem(node.kafka_out, node.kafka_logs / 'server.log')}"
                    f" (logs in {node.kafka_logs})"
                )

    def redis_check() -> None:
        if redis_pid is not None and not alive(redis_pid, redis_owner(layout)):
            raise DevStackError(f"redis exited during startup: {last_problem(layout.redis_log)}")

    waits: list[Awaitable[object]] = []
    security = local_client_security(layout)
    if kafka_pid is not None and len(nodes) > 1:
        bootstrap = cluster_bootstrap(nodes)
        waits.append(wait_for_brokers(bootstrap, len(nodes), KAFKA_START_TIMEOUT_S, kafka_check, security))
    elif kafka_pid is not None:
        waits.append(wait_for_kafka(layout.bootstrap, KAFKA_START_TIMEOUT_S, check=kafka_check, settings=security))
    if redis_pid is not None:
        waits.append(wait_for_redis(layout.redis_url, REDIS_START_TIMEOUT_S, check=redis_check))
    try:
        await asyncio.gather(*waits)
    except TimeoutError as exc:
        raise DevStackError(f"{exc} (logs in {layout.state})") from exc


def status(settings: Settings | None = None) -> StackStatus:
    """What runs (by pid file and command line) and whether each address answers a request."""
    layout = StackLayout.of(settings or get_settings())
    kafka_pid = running_pid(layout.kafka_pid, kafka_owner(layout))
    redis_pid = running_pid(layout.redis_pid, redis_owner(layout))

    async def probe() -> tuple[str | None, str | None]:
        async def kafka() -> str | None:
            try:
                cluster = await probe_kafka(layout.bootstrap, timeout_s=3.0, settings=local_client_security(layout))
            except (ConnectionError, KafkaAccessError):
                return None
            return f"cluster {cluster.get('cluster_id')}"

        async def redis() -> str | None:
            try:
                return f"redis {await wait_for_redis(layout.redis_url, timeout_s=1.0)}"
            except TimeoutError:
                return None

        return await asyncio.gather(kafka(), redis())

    kafka_detail, redis_detail = run_coro(probe())
    return StackStatus(
        kafka=ServiceStatus(
            "kafka",
            layout.bootstrap,
            kafka_pid,
            kafka_detail is not None,
            layout.kafka_logs / "server.log",
            kafka_detail or "",
        ),
        redis=ServiceStatus(
            "redis", layout.redis_url, redis_pid, redis_detail is not None, layout.redis_log, redis_detail or ""
        ),
    )


def down(settings: Settings | None = None, services: tuple[str, ...] = SERVICES) -> None:
    """Stop Kafka and Redis (SIGTERM, wait, then SIGKILL) and remove their pid files. Data is kept.

    ``services`` limits the stop to some of them (a test session stops only what it started).
    """
    _check_services(services)
    layout = StackLayout.of(settings or get_settings())
    with locked(layout.state):
        ours: dict[str, Running] = {}
        # Every node of a multi-broker stack (its size is recorded in node 0's folder).
        kafka_nodes = node_layouts(layout, recorded_size(layout))
        for name, pid_file, owns, timeout_s in (
            *(
                (f"kafka-{i}" if i else "kafka", node.kafka_pid, kafka_owner(node), KAFKA_STOP_TIMEOUT_S)
                for i, node in enumerate(kafka_nodes)
            ),
            ("redis", layout.redis_pid, redis_owner(layout), REDIS_STOP_TIMEOUT_S),
        ):
            if name.split("-")[0] not in services:
                continue
            pid = running_pid(pid_file, owns)
            if pid is None:
                log.info("devstack.not_running service=%s", name)
            else:
                ours[name] = Running(pid, pid_file, owns, timeout_s)
        stop(ours)


def main(argv: list[str] | None = None) -> int:
    """``python -m cli.backbone.devstack fetch|up|status|down`` (CI and scripts; users have the CLI)."""
    parser = argparse.ArgumentParser(prog="python -m cli.backbone.devstack", description=main.__doc__)
    parser.add_argument("command", choices=["fetch", "up", "status", "down"])
    parser.add_argument(
        "--kafka-security",
        choices=["plaintext", "sasl_ssl"],
        default=None,
        help="the broker's client listener (default: SLUICEGATE_KAFKA_LOCAL_SECURITY, else plaintext)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    settings = get_settings()
    if args.kafka_security is not None:
        settings = settings.model_copy(update={"kafka_local_security": args.kafka_security})
    try:
        if args.command == "fetch":
            print(fetch_jars(settings))
        elif args.command == "up":
            print("\n".join(up(settings).lines()))
        elif args.command == "status":
            result = status(settings)
            print("\n".join(result.lines()))
            return 0 if result.healthy else 3
        else:
            down(settings)
    except DevStackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
