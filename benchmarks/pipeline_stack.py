"""The pipeline benchmark's stack: Kafka and Redis (a private dev stack or the addresses given), ingress and the
result service as ``sluicegate`` subprocesses, and one worker in a child process of the benchmark with timing
probes that stamp when a request's record reaches the worker, its engine timestamps, and when its first token's
XADD goes out. The ``secure`` transport runs the same services on a private stack of its own whose broker speaks
SASL_SSL (SCRAM-SHA-512) and whose Redis speaks TLS only, each service logging in as its own ACL user.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks import relay
from benchmarks.common import REPO_ROOT, free_port, progress, start_private_stack, start_service
from schemas import Names, WorkerHeartbeat
from sluicegate.settings import Settings

MODEL_NAME = "tiny-bench"
API_KEY = "sk-pipeline-benchmark"
WORKER_ID = "bench-worker"


class _StageStamps:
    """The worker's observer (``gpu_workers.worker.observer.WorkerObserver``) and the engine's delta observer:
    stamps when the worker takes a request's Kafka record, when the engine's first token reaches the worker's
    loop, when its XADD goes out, and each finished request's engine timestamps."""

    def __init__(self, stamps: dict[str, dict[str, float]]) -> None:
        self.stamps = stamps

    def record_taken(self, record: Any) -> None:
        from schemas.names import HEADER_REQUEST_ID

        now = time.time()
        for key, value in record.headers or ():
            if key == HEADER_REQUEST_ID:
                entry = self.stamps.setdefault(value.decode(), {})
                entry.setdefault("admitted", now)
                if record.timestamp_type == 0:  # CreateTime: when ingress handed the record to its producer
                    entry.setdefault("produced", record.timestamp / 1000)

    def events_sending(self, batch: Sequence[Any]) -> None:
        # Stamped as the pipeline goes out: once Redis has it, the relay may deliver it before this task resumes.
        now = time.time()
        for event in batch:
            if getattr(event, "seq", None) == 0 and getattr(event, "type", None) == "token":
                self.stamps.setdefault(event.request_id, {}).setdefault("flushed", now)

    def deltas(self, deltas: list[Any]) -> None:
        # Every delta reaches the worker's event loop here, from a thread or a process engine alike.
        now = time.time()
        for delta in deltas:
            entry = self.stamps.setdefault(delta.request_id, {})
            if delta.num_output_tokens:
                entry.setdefault("delivered", now)
            if delta.final is not None and delta.final.metrics.first_token_time is not None:
                metrics = delta.final.metrics
                entry["arrival"] = metrics.arrival_time
                entry["first_token"] = metrics.first_token_time


def _worker_main(settings_json: str, out_dir: str) -> None:
    """Run the worker (as ``sluicegate worker`` does) with timing probes until SIGTERM; then write the stamps.

    Its output goes to ``worker.log`` in ``out_dir``, the stamps to ``stamps.json``.
    """
    log = os.open(Path(out_dir) / "worker.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from gpu_workers.worker.main import build_engine, run_worker
    from sluicegate import event_loop
    from sluicegate.logs import configure_logging

    settings = Settings.model_validate_json(settings_json)
    configure_logging(settings.log_level, settings.log_format)
    stamps: dict[str, dict[str, float]] = {}
    observer = _StageStamps(stamps)
    engine = build_engine(settings)
    engine.add_delta_observer(observer.deltas)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(settings, stop, engine, freeze_heap=True, observer=observer)

    event_loop.run(main())  # as ``sluicegate worker`` runs it
    (Path(out_dir) / "stamps.json").write_text(json.dumps({"probes": True, "stamps": stamps}))


def pin(stack: Stack) -> dict[str, set[int]]:
    """Pin the worker and its engine process to the last CPU and everything else (Kafka, Redis, ingress, the result
    service and this load generator) to the others: every thread of each (``/proc/<pid>/task``). Returns the CPUs
    each role got. The engine and the services then stop taking turns on one core: what the overhead would be if
    the GPU worker had its own machine, as it does when deployed."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("--pin needs at least 2 CPUs")
    worker_cpus, other_cpus = {cpus[-1]}, set(cpus[:-1])
    placed: dict[str, set[int]] = {}
    for role, pid in {**stack.pids(), "clients": os.getpid()}.items():
        target = worker_cpus if role in ("worker", "engine") else other_cpus
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(task.name), target)
        placed[role] = target
    return placed


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


@dataclass
class Stack:
    """The running pipeline: backbone addresses, service processes, and what to tear down."""

    settings: Settings
    env: dict[str, str]
    workdir: Path
    services: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker: multiprocessing.process.BaseProcess | None = None
    teardown: list[Callable[[], None]] = field(default_factory=list)
    backbone_pids: dict[str, int] = field(default_factory=dict)
    #: Per service (``ingress``, ``result-service``): variables only it gets (its own Redis user).
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        """Every process of the pipeline whose pid is known, by role."""
        pids = {name: process.pid for name, process in self.services.items()}
        if self.worker is not None and self.worker.pid is not None:
            pids["worker"] = self.worker.pid
            for child in _children(self.worker.pid):
                pids["engine"] = child  # the worker's engine process (none with SLUICEGATE_ENGINE_PROCESS=false)
        return pids | self.backbone_pids

    @property
    def ingress_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ingress_port}"

    @property
    def result_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.result_port}"

    def spawn(self, name: str, *args: str) -> None:
        self.services[name] = start_service(self.workdir, name, args, {**self.env, **self.service_env.get(name, {})})

    def check_alive(self) -> None:
        for name, process in self.services.items():
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with code {process.returncode}:\n{self.log_tail(name)}")
        if self.worker is not None and not self.worker.is_alive():
            raise SystemExit(f"worker exited with code {self.worker.exitcode}:\n{self.log_tail('worker')}")

    def log_tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def stop_worker(self) -> dict[str, Any]:
        """SIGTERM the worker (it drains) and read the stamps it wrote on the way out."""
        if self.worker is None:
            return {"probes": False, "stamps": {}}
        self.worker.terminate()
        self.worker.join(60)
        if self.worker.is_alive():
            self.worker.kill()
            raise SystemExit("the worker did not stop within 60 s")
        self.worker = None
        path = self.workdir / "stamps.json"
        if not path.exists():
            raise SystemExit(f"the worker wrote no timings:\n{self.log_tail('worker')}")
        return json.loads(path.read_text())

    def close(self) -> None:
        if self.worker is not None and self.worker.pid is not None:
            self.worker.terminate()
            self.worker.join(30)
        for process in self.services.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.services.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        for step in reversed(self.teardown):
            step()


def backbone(args: argparse.Namespace) -> tuple[str, str, dict[str, int], Callable[[], None] | None]:
    """Kafka bootstrap, Redis URL, their pids when known, and how to stop them: the addresses given, or a
    private dev stack (stopped afterwards if started here)."""
    if args.kafka_bootstrap and args.redis_url:
        return args.kafka_bootstrap, args.redis_url, {}, None
    if args.kafka_bootstrap or args.redis_url:
        raise SystemExit("pass both --kafka-bootstrap and --redis-url, or neither")
    progress(f"starting Kafka on :{args.kafka_port} and Redis on :{args.redis_port} (cli.backbone.devstack) ...")
    private = start_private_stack(args.kafka_port, args.redis_port, full_jit=args.broker_jit == "full")
    info = private.info
    pids = {name: pid for name, pid in (("kafka", info.kafka_pid), ("redis", info.redis_pid)) if pid is not None}
    return info.kafka_bootstrap, info.redis_url, pids, private.close


@dataclass(frozen=True)
class SecureBackbone:
    """A private stack with a SASL_SSL broker and a TLS-only Redis: the admin's Redis URL (readiness checks, the
    load generator), each service's own, and the Settings fields that reach the broker as the service user."""

    bootstrap: str
    redis_url: str
    service_redis_urls: dict[str, str]
    kafka_fields: dict[str, str]
    pids: dict[str, int]
    down: Callable[[], None]


def secure_backbone(args: argparse.Namespace, prefix: str) -> SecureBackbone:
    """The ``secure`` transport's private stack on ``--secure-kafka-port`` / ``--secure-redis-port``, with the Redis
    ACL users of the deployment under ``prefix`` loaded (``ACL SETUSER``, as the admin)."""
    import redis

    from cli.backbone.redis_server import acl_passwords
    from cli.stack.layout import StackLayout
    from sluicegate.redis_acl import service_acl, setuser_lines

    progress(f"starting SASL_SSL Kafka on :{args.secure_kafka_port} and TLS Redis on :{args.secure_redis_port} ...")
    private = start_private_stack(
        args.secure_kafka_port, args.secure_redis_port, full_jit=args.broker_jit == "full", secure=True
    )
    info, layout = private.info, StackLayout.of(private.settings)
    services, passwords = ("ingress", "result-service", "worker"), acl_passwords(layout)
    with redis.Redis.from_url(info.redis_url) as admin:
        for line in setuser_lines(prefix, passwords, services):
            admin.execute_command(*line.split())  # passwords are URL-safe tokens: no spaces
    tls_query = info.redis_url.partition("?")[2]
    urls = {
        service: f"rediss://{service_acl(service).user}:{passwords[service]}@127.0.0.1:{layout.redis_port}/0?{tls_query}"
        for service in services
    }
    fields = {key.removeprefix("SLUICEGATE_").lower(): value for key, value in info.kafka_env.items()}
    fields.pop("kafka_bootstrap")  # the backbone's own field
    pids = {name: pid for name, pid in (("kafka", info.kafka_pid), ("redis", info.redis_pid)) if pid is not None}
    return SecureBackbone(info.kafka_bootstrap, info.redis_url, urls, fields, pids, private.close)


def start_stack(
    args: argparse.Namespace, workdir: Path, extra_env: dict[str, str] | None = None, *, transport: str = "plain"
) -> Stack:
    """Backbone, tiny model, ingress, result service and the timed worker; returns once the worker heartbeats.

    ``extra_env`` is added to every service's environment (settings a benchmark needs beyond these);
    ``transport`` ``secure``: on :func:`secure_backbone`'s stack instead of the plaintext one."""
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    prefix = f"pb{uuid.uuid4().hex[:6]}."
    secure = secure_backbone(args, prefix) if transport == "secure" else None
    if secure is not None:
        bootstrap, redis_url, backbone_pids, down = secure.bootstrap, secure.redis_url, secure.pids, secure.down
    else:
        bootstrap, redis_url, backbone_pids, down = backbone(args)
    with contextlib.ExitStack() as guard:  # a failure before the stack exists stops the backbone started here
        if down is not None:
            guard.callback(down)
        weights: dict[str, str] = {}
        if getattr(args, "model", "tiny") == "smollm2":
            from cli.stack.launcher import default_model

            spec = default_model(Settings())  # fetched once into the state folder, as `sluicegate up` does
            if spec.description:
                raise RuntimeError(f"--model smollm2: the real model could not be fetched ({spec.description})")
            model = Path(spec.path)
            weights = {"dtype": spec.dtype or "auto", "quantization": spec.quantization or ""}
        else:
            progress("building the tiny model ...")
            model = make_tiny_model(workdir / MODEL_NAME, arch="llama", num_layers=2, hidden_size=64)
        settings = Settings(
            kafka_bootstrap=bootstrap,
            redis_url=redis_url,
            topic_prefix=prefix,
            topic_partitions=args.partitions,
            ingress_port=free_port(),
            result_port=free_port(),
            api_keys=API_KEY,
            # The relay scenarios sign their stream tokens with the relay benchmark's secret.
            stream_token_secret=relay.SECRET,
            model=str(model),
            model_name=MODEL_NAME,
            worker_id=WORKER_ID,
            device="cpu",
            kv_cache_gb=0.25,
            log_level=args.log_level,
            # The tiny model gains nothing from a second thread on a shared 2-core machine.
            torch_threads=1,
            engine_mode=args.engine,
            # As deployed: the worker serves its metrics (nobody scrapes here), and traces go where --tracing says.
            worker_metrics_port=free_port(),
            otlp_endpoint=getattr(args, "otlp_endpoint", ""),
            metrics_enabled=getattr(args, "metrics", "on") == "on",
            **weights,
            **(secure.kafka_fields if secure is not None else {}),
        )
        settings = settings.model_copy(update={"public_stream_url": f"ws://127.0.0.1:{settings.result_port}"})
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        env = {k: v for k, v in env.items() if not k.startswith("SLUICEGATE_")}
        for name, value in settings.model_dump(mode="json").items():
            if value is not None:
                env[f"SLUICEGATE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        env.update(extra_env or {})
        stack = Stack(settings, env, workdir, backbone_pids=backbone_pids)
        worker_settings = settings
        if secure is not None:
            urls = secure.service_redis_urls
            stack.service_env = {name: {"SLUICEGATE_REDIS_URL": urls[name]} for name in ("ingress", "result-service")}
            worker_settings = settings.model_copy(update={"redis_url": urls["worker"]})
        if down is not None:
            stack.teardown.append(down)
        guard.pop_all()  # from here on the stack's own teardown stops its backbone
    try:
        context = multiprocessing.get_context("spawn")
        stack.worker = context.Process(
            target=_worker_main, args=(worker_settings.model_dump_json(), str(workdir)), daemon=False
        )
        stack.worker.start()
        stack.spawn("ingress", "ingress")
        stack.spawn("result-service", "result-service")
        progress("waiting for ingress, the result service and the worker ...")
        asyncio.run(_wait_ready(stack))
    except BaseException:
        stack.close()
        raise
    return stack


async def _wait_ready(stack: Stack, timeout_s: float = 120.0) -> None:
    from redis.asyncio import Redis

    deadline = time.monotonic() + timeout_s
    key = Names(stack.settings.topic_prefix).workers_key(MODEL_NAME)
    redis = Redis.from_url(stack.settings.redis_url)
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            pending = [f"{stack.ingress_url}/healthz", f"{stack.result_url}/healthz"]
            while True:
                stack.check_alive()
                if time.monotonic() > deadline:
                    raise SystemExit(f"the pipeline did not come up within {timeout_s:.0f}s: waiting for {pending}")
                for url in list(pending):
                    try:
                        if (await client.get(url)).status_code == 200:
                            pending.remove(url)
                    except httpx.HTTPError:
                        pass
                raw = await redis.hget(key, WORKER_ID)
                if raw is not None and WorkerHeartbeat.model_validate_json(raw).partitions:
                    if "worker" in pending:
                        pending.remove("worker")
                elif "worker" not in pending:
                    pending.append("worker")
                if not pending:
                    return
                await asyncio.sleep(0.3)
    finally:
        await redis.aclose()
