"""The nemesis run's stack: 3 KRaft brokers bound to the bridge address of ``benchmarks.nemesis_faults``
(``cli.backbone.devstack`` with ``kafka_brokers=3`` and ``kafka_host``), a Redis primary, replica and three
Sentinels (``benchmarks.redis_failover``) on the bridge's other address, ``redis-cli monitor`` on the primary (the
command log ``benchmarks.nemesis_history`` attributes appends from), the router, ingress, result service and a Celery
batch worker in this namespace, and the workers each in a network namespace of its own, on a random-weight model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import REPO_ROOT, start_service
from benchmarks.nemesis_faults import Fault, WorkerNetwork, pause, signal_group
from benchmarks.redis_failover import SentinelSet
from cli.backbone import devstack
from cli.backbone.kafka_cluster import node_layouts
from cli.stack.layout import StackLayout
from schemas import Names, WorkerHeartbeat
from sluicegate.settings import Settings

API_KEY = "sk-nemesis-key"
MODEL = "tiny-nemesis"
BROKERS = 3


@dataclass
class Stack:
    """Every process of the run and how to reach it."""

    args: argparse.Namespace
    workdir: Path
    net: WorkerNetwork
    env: dict[str, str] = field(default_factory=dict)
    services: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    workers: list[str] = field(default_factory=list)
    settings: Settings | None = None
    sentinels: SentinelSet | None = None
    monitor: subprocess.Popen[bytes] | None = None
    ingress: str = ""
    result_ws: str = ""

    def start(self, name: str, *cli: str) -> None:
        self.services[name] = start_service(self.workdir, name, cli, self.env)

    def start_worker(self, name: str) -> None:
        env = {**self.env, "SLUICEGATE_WORKER_ID": name}
        command = [sys.executable, "-m", "cli.main", "worker"]
        self.services[name] = self.net.spawn(name, command, env, self.workdir / f"{name}.log")

    def up(self) -> None:
        base = self.args.first_port
        self.net.up()
        self.sentinels = SentinelSet(self.workdir, host=self.net.redis_host, first_port=base + 2 * BROKERS + 2)
        self.sentinels.start()
        self.settings = Settings(
            state_dir=REPO_ROOT / ".sluicegate",
            kafka_port=base,
            redis_port=base + 2 * BROKERS,
            kafka_brokers=BROKERS,
            kafka_host=self.net.kafka_host,
            topic_partitions=self.args.partitions,
        )
        info = devstack.up(self.settings, services=("kafka",))
        asyncio.run(self.sentinels.replica_in_sync())
        monitor_log = (self.workdir / "monitor.log").open("wb")
        self.monitor = subprocess.Popen(
            ["redis-cli", "-h", self.net.redis_host, "-p", str(self.sentinels.ports["primary"]), "monitor"],
            stdout=monitor_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        ingress_port, result_port = base + 2 * BROKERS + 10, base + 2 * BROKERS + 11
        self.ingress, self.result_ws = f"http://127.0.0.1:{ingress_port}", f"ws://127.0.0.1:{result_port}"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "OMP_NUM_THREADS": "1",
            "SLUICEGATE_KAFKA_BOOTSTRAP": info.kafka_bootstrap,
            "SLUICEGATE_REDIS_URL": self.sentinels.url,
            "SLUICEGATE_TOPIC_PREFIX": f"nem{uuid.uuid4().hex[:8]}.",
            "SLUICEGATE_TOPIC_PARTITIONS": str(self.args.partitions),
            "SLUICEGATE_API_KEYS": API_KEY,
            "SLUICEGATE_STREAM_TOKEN_SECRET": uuid.uuid4().hex,
            "SLUICEGATE_MODEL": str(self.args.model_dir),
            "SLUICEGATE_MODEL_NAME": MODEL,
            "SLUICEGATE_SERVED_MODELS": MODEL,  # no 404 while every worker's heartbeat is stale (all faulted)
            "SLUICEGATE_INGRESS_PORT": str(ingress_port),
            "SLUICEGATE_RESULT_PORT": str(result_port),
            "SLUICEGATE_PUBLIC_STREAM_URL": self.result_ws,
            "SLUICEGATE_HEARTBEAT_INTERVAL_S": "0.5",
            "SLUICEGATE_KV_CACHE_GB": "0.05",
            "SLUICEGATE_WORKER_SESSION_TIMEOUT_MS": str(self.args.session_timeout_ms),
            "SLUICEGATE_WORKER_METRICS_PORT": "0",
            "SLUICEGATE_ROUTER_METRICS_PORT": "0",
            "SLUICEGATE_BATCH_METRICS_PORT": "0",
            "SLUICEGATE_LIMIT_RPS": "100000",
            "SLUICEGATE_FILES_URL": str(self.workdir / "files"),
            "SLUICEGATE_STATE_DIR": str(self.workdir),  # the batch worker's beat schedule goes with the run
            "SLUICEGATE_BATCH_TICK_S": "0.5",
        }
        for i in range(self.args.workers):
            name = f"w{i}"
            self.net.add_worker(name)
            self.workers.append(name)
            self.start_worker(name)
        for service in ("router", "ingress", "result-service", "batch-worker"):
            self.start(service, service)
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        names = Names(self.env["SLUICEGATE_TOPIC_PREFIX"])
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.ingress}/readyz", timeout=2).status_code == 200 and self.owners(names) == set(
                    self.workers
                ):
                    return
            dead = [n for n, p in self.services.items() if p.poll() is not None]
            if time.monotonic() > deadline or dead:
                raise SystemExit(f"stack not ready (dead: {dead}); logs in {self.workdir}")
            time.sleep(1.0)

    def owners(self, names: Names) -> set[str]:
        """Workers whose latest heartbeat lists partitions (they joined the group)."""
        import redis

        assert self.sentinels is not None
        client = redis.Redis.from_url(self.sentinels.node_url("primary"))
        try:
            beats = [WorkerHeartbeat.model_validate_json(v) for v in client.hgetall(names.workers_key(MODEL)).values()]
        finally:
            client.close()
        return {b.worker_id for b in beats if b.partitions and time.time() - b.sent_at.timestamp() < 5}

    def down(self) -> None:
        for process in self.services.values():
            with contextlib.suppress(ProcessLookupError):
                signal_group(process, signal.SIGCONT)  # a paused worker must be able to stop
                process.send_signal(signal.SIGTERM)
        for process in self.services.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                signal_group(process, signal.SIGKILL)
        if self.monitor is not None:
            self.monitor.kill()
        if self.settings is not None:
            devstack.down(self.settings, services=("kafka",))
            for node in node_layouts(StackLayout.of(self.settings), BROKERS):
                shutil.rmtree(node.kafka_dir, ignore_errors=True)
        if self.sentinels is not None:
            self.sentinels.stop()
        self.net.close()


async def inject(stack: Stack, fault: Fault) -> tuple[float, float]:
    """Run one fault to its end; returns its (start, end) in wall-clock seconds (Redis's MONITOR clock)."""
    started = time.time()
    process = stack.services[fault.worker]
    if fault.kind == "kill":
        signal_group(process, signal.SIGKILL)
        await asyncio.to_thread(process.wait)
        await asyncio.sleep(fault.hold_s)
        stack.start_worker(fault.worker)
    elif fault.kind == "pause":
        await asyncio.to_thread(pause, process, fault.hold_s)
    else:
        target = "kafka" if fault.kind == "partition_kafka" else "redis"
        stack.net.partition(fault.worker, target)
        try:
            await asyncio.sleep(fault.hold_s)
        finally:
            stack.net.heal(fault.worker, target)
    return started, time.time()
