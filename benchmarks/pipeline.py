"""Request-path benchmark: what the pipeline adds on top of the engine, and how fast the relay fans out.

The whole pipeline runs on the tiny random-weight model on CPU: Kafka and Redis (a private
``sluicegate.stack.devstack`` on non-default ports, or the addresses given), ingress and the result service as
``sluicegate`` subprocesses, one worker in a child process of this script. At each rate (10, 50 and 100
requests/s by default) open-loop Poisson arrivals each ``POST /v1/requests`` (short prompt, ``max_tokens``
8, greedy) and then read the stream over the WebSocket the response names.

Overhead of one request = (first token received on the WebSocket - POST sent) - the engine's own TTFT
for that request. The engine TTFT is taken worker-side: the worker child wraps the engine's delta delivery
and keeps each request's ``RequestMetrics`` (arrival and first-token times, ``time.time()``, a clock every
process on the host shares). The child also stamps when a request's Kafka record reaches the worker and
when the XADD of its first token is sent, which splits the overhead into four stages:

* ``ingress+kafka``: POST sent -> the worker holds the Kafka record (HTTP, validation, status record,
  publish with ``acks=all``, broker, consumer fetch);
* ``pickup``: record -> ``engine.generate`` (stream state, cancel marker and status record in Redis);
* ``emit``: the engine's first token -> its XADD sent (engine process or thread -> worker event loop, shown alone
  as "engine -> worker loop", -> flush task);
* ``relay``: XADD sent -> the client has the event (Redis, result service XREAD, WebSocket frame). The
  client opens the WebSocket after the POST answers, so its connect overlaps the earlier stages.

Relay throughput reuses :func:`benchmarks.relay.run_scenario` (``max`` mode: producers append as fast as
Redis takes them) against this pipeline's result service, with 100 and 500 clients, 10 per stream.

The private broker runs with its full JIT (C2, as a production broker does; the dev stack caps it at C1 for a
fast start), and 30 s of 100 requests/s warm the whole path up before anything is measured.

Run: ``python -m benchmarks.pipeline`` (``--help`` lists the knobs). Targets on a 2-core machine: overhead
p50 <= 5 ms and p99 <= 20 ms at 50 requests/s; >= 50,000 tokens/s relayed to 500 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from websockets.uri import parse_uri

from benchmarks import relay
from benchmarks.common import (
    fmt,
    free_port,
    markdown_table,
    percentile,
    process_cpu_seconds,
    start_private_stack,
    use_uvloop,
)
from benchmarks.http1 import Http1Pool
from schemas import Names, WorkerHeartbeat
from sluicegate.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "tiny-bench"
API_KEY = "sk-pipeline-benchmark"
WORKER_ID = "bench-worker"
# Not the defaults (9092/6379) nor the test session's (19092/16379).
DEFAULT_KAFKA_PORT = 29692
DEFAULT_REDIS_PORT = 26692
STAGES = ("ingress+kafka", "pickup", "emit", "relay")
TARGET_RATE = 50.0
TARGET_P50_MS = 5.0
TARGET_P99_MS = 20.0
TARGET_RELAY_CLIENTS = 500
TARGET_RELAY_TOKENS_S = 50_000.0


# --- the worker child ------------------------------------------------------------------------------------


def _install_stage_probes(stamps: dict[str, dict[str, float]]) -> bool:
    """Stamp when the worker takes a Kafka record and when it sends a first token's XADD (private hooks of
    the worker; False, and no stage split, when they are not there).

    The worker has no public observer for these two moments yet, so its private methods are wrapped; the
    benchmark degrades to "no stage split" rather than failing when they move.
    """
    from schemas.names import HEADER_REQUEST_ID

    try:
        from gpu_workers.worker import service, streams
    except ImportError:
        return False

    admit = getattr(service.Worker, "_admit", None)
    append = getattr(streams.StreamPublisher, "_append", None)
    if admit is None or append is None:
        return False

    def timed_admit(self: Any, record: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.time()
        for key, value in record.headers or ():
            if key == HEADER_REQUEST_ID:
                entry = stamps.setdefault(value.decode(), {})
                entry.setdefault("admitted", now)
                if record.timestamp_type == 0:  # CreateTime: when ingress handed the record to its producer
                    entry.setdefault("produced", record.timestamp / 1000)
        return admit(self, record, *args, **kwargs)

    async def timed_append(self: Any, batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        # Stamped as the pipeline goes out: once Redis has it, the relay may deliver it before this task resumes.
        now = time.time()
        for event in batch:
            if getattr(event, "seq", None) == 0 and getattr(event, "type", None) == "token":
                stamps.setdefault(event.request_id, {}).setdefault("flushed", now)
        return await append(self, batch, *args, **kwargs)

    service.Worker._admit = timed_admit  # type: ignore[method-assign]
    streams.StreamPublisher._append = timed_append  # type: ignore[method-assign]
    return True


def _install_engine_probe(stamps: dict[str, dict[str, float]]) -> bool:
    """Keep each finished request's engine timestamps, and when its first token reached the worker's loop.

    The engine front has no public delta observer yet, so its private ``_deliver`` is wrapped; False (and no
    engine timings) when it is not there.
    """
    from gpu_workers.engine import EngineFront, RequestDelta

    deliver = getattr(EngineFront, "_deliver", None)
    if deliver is None:
        return False

    def timed_deliver(self: Any, deltas: list[RequestDelta]) -> None:
        # Every delta reaches the worker's event loop through here, from a thread or a process engine alike.
        now = time.time()
        for delta in deltas:
            entry = stamps.setdefault(delta.request_id, {})
            if delta.num_output_tokens:
                entry.setdefault("delivered", now)
            if delta.final is not None and delta.final.metrics.first_token_time is not None:
                metrics = delta.final.metrics
                entry["arrival"] = metrics.arrival_time
                entry["first_token"] = metrics.first_token_time
        deliver(self, deltas)

    EngineFront._deliver = timed_deliver  # type: ignore[method-assign]
    return True


def _worker_main(settings_json: str, out_dir: str) -> None:
    """Run the worker (as ``sluicegate worker`` does) with timing probes until SIGTERM; then write the stamps.

    Its output goes to ``worker.log`` in ``out_dir``, the stamps to ``stamps.json``.
    """
    log = os.open(Path(out_dir) / "worker.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from gpu_workers.worker.main import run_worker
    from sluicegate import event_loop
    from sluicegate.logs import configure_logging

    settings = Settings.model_validate_json(settings_json)
    configure_logging(settings.log_level, settings.log_format)
    stamps: dict[str, dict[str, float]] = {}
    probes = _install_stage_probes(stamps)
    if not _install_engine_probe(stamps):
        print("the engine's private _deliver was not found: no engine timings", file=sys.stderr, flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(settings, stop, freeze_heap=True)

    event_loop.run(main())  # as ``sluicegate worker`` runs it
    (Path(out_dir) / "stamps.json").write_text(json.dumps({"probes": probes, "stamps": stamps}))


# --- processes ---------------------------------------------------------------------------------------------


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
        log = (self.workdir / f"{name}.log").open("ab")
        self.services[name] = subprocess.Popen(
            [sys.executable, "-m", "sluicegate.stack.cli", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )

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


def _backbone(args: argparse.Namespace) -> tuple[str, str, dict[str, int], Callable[[], None] | None]:
    """Kafka bootstrap, Redis URL, their pids when known, and how to stop them: the addresses given, or a
    private dev stack (stopped afterwards if started here)."""
    if args.kafka_bootstrap and args.redis_url:
        return args.kafka_bootstrap, args.redis_url, {}, None
    if args.kafka_bootstrap or args.redis_url:
        raise SystemExit("pass both --kafka-bootstrap and --redis-url, or neither")
    _progress(f"starting Kafka on :{args.kafka_port} and Redis on :{args.redis_port} (sluicegate.stack.devstack) ...")
    private = start_private_stack(args.kafka_port, args.redis_port, full_jit=args.broker_jit == "full")
    info = private.info
    pids = {name: pid for name, pid in (("kafka", info.kafka_pid), ("redis", info.redis_pid)) if pid is not None}
    return info.kafka_bootstrap, info.redis_url, pids, private.close


def start_stack(args: argparse.Namespace, workdir: Path) -> Stack:
    """Backbone, tiny model, ingress, result service and the timed worker; returns once the worker heartbeats."""
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    bootstrap, redis_url, backbone_pids, down = _backbone(args)
    _progress("building the tiny model ...")
    model = make_tiny_model(workdir / MODEL_NAME, arch="llama", num_layers=2, hidden_size=64)
    settings = Settings(
        kafka_bootstrap=bootstrap,
        redis_url=redis_url,
        topic_prefix=f"pb{uuid.uuid4().hex[:6]}.",
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
    )
    settings = settings.model_copy(update={"public_stream_url": f"ws://127.0.0.1:{settings.result_port}"})
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("SLUICEGATE_")}
    for name, value in settings.model_dump(mode="json").items():
        if value is not None:
            env[f"SLUICEGATE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    stack = Stack(settings, env, workdir, backbone_pids=backbone_pids)
    if down is not None:
        stack.teardown.append(down)
    try:
        context = multiprocessing.get_context("spawn")
        stack.worker = context.Process(
            target=_worker_main, args=(settings.model_dump_json(), str(workdir)), daemon=False
        )
        stack.worker.start()
        stack.spawn("ingress", "ingress")
        stack.spawn("result-service", "result-service")
        _progress("waiting for ingress, the result service and the worker ...")
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


# --- load ---------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One request as the client saw it (``time.time()`` seconds)."""

    sent: float = 0.0
    accepted: float = 0.0
    first: float = 0.0
    done: float = 0.0
    lateness: float = 0.0
    request_id: str = ""
    tokens: int = 0
    error: str | None = None


class _StreamReader(relay.SansIOWebSocket):
    """Follows one request's stream, stamping events as their bytes arrive, so the client's own scheduling
    delays do not count as pipeline latency."""

    clock = staticmethod(time.time)

    def __init__(self, url: str, sample: Sample) -> None:
        super().__init__(url)
        self.sample = sample
        self.next_seq = 0
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_text(self, data: str | bytes, now: float) -> None:
        sample = self.sample
        event = json.loads(data)
        if event["seq"] != self.next_seq and sample.error is None:
            sample.error = f"seq {event['seq']} where {self.next_seq} was due"
        self.next_seq = event["seq"] + 1
        if event["type"] == "token":
            sample.first = sample.first or now
            sample.tokens += len(event["token_ids"])
        elif event["type"] in ("done", "error"):
            sample.done = now
            if event["type"] == "error":
                sample.error = f"error event: {event.get('code')}: {event.get('message')}"

    def on_handshake_failed(self, message: str) -> None:
        if self.sample.error is None:
            self.sample.error = message

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.sample.done and self.sample.error is None:
            close = self.ws.close_rcvd
            self.sample.error = f"connection closed before done (close {close.code if close else None}, {exc!r})"
        if not self.closed.done():
            self.closed.set_result(None)


async def _one_request(client: Http1Pool, body: dict[str, Any], sample: Sample, timeout_s: float) -> None:
    try:
        response = await client.post_json("/v1/requests", body, clock=time.time)
        sample.sent = response.sent_at  # as the bytes are written, so no client library time counts
        sample.accepted = time.time()
        if response.status != 202:
            sample.error = f"POST answered {response.status}: {response.body[:200]!r}"
            return
        submitted = response.json()
        sample.request_id = submitted["request_id"]
        url = f"{submitted['stream_url']}?token={submitted['stream_token']}"
        uri = parse_uri(url)
        loop = asyncio.get_running_loop()
        _, reader = await loop.create_connection(lambda: _StreamReader(url, sample), uri.host, uri.port)
        await asyncio.wait_for(reader.closed, timeout_s)
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: h11's protocol errors, bad JSON
        sample.error = sample.error or repr(exc)


def _arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (seconds) over ``duration_s``."""
    offsets, t = [], rng.expovariate(rate)
    while t < duration_s:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def run_rate(
    stack: Stack, rate: float, duration_s: float, *, max_tokens: int, seed: int, label: str = ""
) -> list[Sample]:
    """Open-loop arrivals at ``rate`` for ``duration_s``; returns once every request ended (or timed out)."""
    rng = random.Random(f"{seed}-{rate}-{label}")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    samples: list[Sample] = []
    host, port = stack.ingress_url.removeprefix("http://").rsplit(":", 1)
    async with Http1Pool(host, int(port), headers) as client:
        loop = asyncio.get_running_loop()
        tasks = []
        start = loop.time()
        for i, offset in enumerate(_arrivals(rate, duration_s, rng)):
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sample = Sample(lateness=max(0.0, loop.time() - start - offset))
            samples.append(sample)
            # Different prompts spread the requests over partitions (the router keys on the prompt prefix).
            body = {
                "model": MODEL_NAME,
                "prompt": f"{label}request {i}: the quick brown fox",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            tasks.append(asyncio.create_task(_one_request(client, body, sample, timeout_s=60)))
        if tasks:
            await asyncio.wait(tasks)
    return samples


async def ingress_timers(stack: Stack) -> dict[str, tuple[float, int]]:
    """Ingress's own timers from ``/metrics``: (sum of seconds, count) of the Kafka publish (until every
    in-sync replica acknowledged) and of ``POST /v1/requests`` handling."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{stack.ingress_url}/metrics")).text
    wanted = {
        "publish": ("sluicegate_ingress_publish_seconds", {}),
        "handler": ("sluicegate_ingress_request_seconds", {"route": "/v1/requests", "method": "POST"}),
    }
    timers = {}
    for name, (family_name, labels) in wanted.items():
        total, count = 0.0, 0
        for family in text_string_to_metric_families(text):
            if family.name != family_name:
                continue
            for sample in family.samples:
                if any(sample.labels.get(k) != v for k, v in labels.items()):
                    continue
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += int(sample.value)
        timers[name] = (total, count)
    return timers


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (all its threads), and of this client process."""
    used = {}
    for name, pid in pids.items():
        try:
            used[name] = process_cpu_seconds(pid)
        except OSError:
            continue
    times = os.times()
    used["clients"] = times.user + times.system
    return used


# --- analysis -------------------------------------------------------------------------------------------------


@dataclass
class Level:
    """The figures of one arrival rate."""

    rate: float
    duration_s: float
    samples: list[Sample]
    #: ms per request: e2e TTFT, engine TTFT, overhead, POST, and the four stages when stamped.
    series: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    unmatched: int = 0
    #: Means over the level from ingress's own timers (ms): Kafka publish, and the whole POST handler.
    publish_mean_ms: float = math.nan
    handler_mean_ms: float = math.nan
    #: CPU milliseconds per request of each process over the level.
    cpu_ms: dict[str, float] = field(default_factory=dict)

    def p(self, name: str, q: float) -> float:
        return percentile(self.series.get(name, []), q)

    @property
    def completed(self) -> int:
        return sum(1 for s in self.samples if s.done and s.error is None)


def analyse(level: Level, stamps: dict[str, dict[str, float]]) -> None:
    """Join the client samples with the worker's stamps into per-request series (ms)."""
    names = ("e2e", "engine", "overhead", "post", "late", "ingress", "kafka", "handback", *STAGES)
    series: dict[str, list[float]] = {name: [] for name in names}
    for sample in level.samples:
        if sample.error is not None or not sample.first:
            level.errors.append(sample.error or "no token received")
            continue
        worker = stamps.get(sample.request_id, {})
        if "arrival" not in worker or "first_token" not in worker:
            level.unmatched += 1
            continue
        e2e = sample.first - sample.sent
        engine = worker["first_token"] - worker["arrival"]
        series["e2e"].append(1000 * e2e)
        series["engine"].append(1000 * engine)
        series["overhead"].append(1000 * (e2e - engine))
        series["post"].append(1000 * (sample.accepted - sample.sent))
        series["late"].append(1000 * sample.lateness)
        if "admitted" in worker and "flushed" in worker:
            series["ingress+kafka"].append(1000 * (worker["admitted"] - sample.sent))
            series["pickup"].append(1000 * (worker["arrival"] - worker["admitted"]))
            series["emit"].append(1000 * (worker["flushed"] - worker["first_token"]))
            series["relay"].append(1000 * (sample.first - worker["flushed"]))
        if "delivered" in worker:
            series["handback"].append(1000 * (worker["delivered"] - worker["first_token"]))
        if "admitted" in worker and "produced" in worker:
            series["ingress"].append(1000 * (worker["produced"] - sample.sent))
            series["kafka"].append(1000 * (worker["admitted"] - worker["produced"]))
    level.series = series


def latency_table(levels: Sequence[Level]) -> str:
    header = [
        "offered req/s",
        "requests",
        "completed",
        "e2e TTFT p50 / p99 ms",
        "engine TTFT p50 / p99 ms",
        "overhead p50 ms",
        "overhead p99 ms",
        "POST p50 / p99 ms",
        "target (p50 <= 5, p99 <= 20 at 50/s)",
    ]
    rows = []
    for lv in levels:
        target = ""
        if lv.rate == TARGET_RATE:
            met = lv.p("overhead", 0.5) <= TARGET_P50_MS and lv.p("overhead", 0.99) <= TARGET_P99_MS
            target = "met" if met else "missed"
        rows.append(
            [
                f"{lv.rate:g}",
                str(len(lv.samples)),
                str(lv.completed),
                f"{fmt(lv.p('e2e', 0.5))} / {fmt(lv.p('e2e', 0.99))}",
                f"{fmt(lv.p('engine', 0.5))} / {fmt(lv.p('engine', 0.99))}",
                fmt(lv.p("overhead", 0.5)),
                fmt(lv.p("overhead", 0.99)),
                f"{fmt(lv.p('post', 0.5))} / {fmt(lv.p('post', 0.99))}",
                target,
            ]
        )
    return markdown_table(header, rows)


def stage_table(levels: Sequence[Level]) -> str:
    header = [
        "offered req/s",
        *(f"{s} p50 / p99 ms" for s in STAGES),
        "of which ingress / Kafka p50 ms (record CreateTime, 1 ms resolution)",
        "of which engine -> worker loop p50 / p99 ms",
        "ingress handler / Kafka publish mean ms",
        "arrival lateness p99 ms",
    ]
    rows = []
    for lv in levels:
        cells = [f"{lv.rate:g}", *(f"{fmt(lv.p(s, 0.5))} / {fmt(lv.p(s, 0.99))}" for s in STAGES)]
        cells.append(f"{fmt(lv.p('ingress', 0.5))} / {fmt(lv.p('kafka', 0.5))}")
        cells.append(f"{fmt(lv.p('handback', 0.5))} / {fmt(lv.p('handback', 0.99))}")
        cells.append(f"{fmt(lv.handler_mean_ms)} / {fmt(lv.publish_mean_ms)}")
        cells.append(fmt(lv.p("late", 0.99)))
        rows.append(cells)
    return markdown_table(header, rows)


def cpu_table(levels: Sequence[Level]) -> str:
    names = sorted({name for lv in levels for name in lv.cpu_ms})
    rows = []
    for lv in levels:
        total = sum(lv.cpu_ms.values())
        busy = total * len(lv.samples) / 1000 / lv.duration_s
        cells = [fmt(lv.cpu_ms.get(name, math.nan)) for name in names]
        rows.append([f"{lv.rate:g}", *cells, f"{total:.1f}", f"{busy:.2f}"])
    return markdown_table(["offered req/s", *names, "total", "cores busy"], rows)


@dataclass
class RelayRow:
    outcome: relay.Outcome

    @property
    def tokens_per_s(self) -> float:
        sc = self.outcome.scenario
        # Each stream carries ``tokens`` token events and one ``done``; only the tokens count here.
        return self.outcome.rate * sc.tokens / (sc.tokens + 1)


def relay_table(rows: Sequence[RelayRow]) -> str:
    header = [
        "clients",
        "streams",
        "events delivered",
        "seconds",
        "tokens/s to clients",
        "latency p50 / p99 ms",
        "result service CPU %",
        "target (>= 50,000 tokens/s at 500)",
    ]
    cells = []
    for row in rows:
        o, sc = row.outcome, row.outcome.scenario
        target = ""
        if sc.clients == TARGET_RELAY_CLIENTS:
            target = "met" if row.tokens_per_s >= TARGET_RELAY_TOKENS_S and not o.errors else "missed"
        cells.append(
            [
                str(sc.clients),
                str(sc.streams),
                f"{o.delivered:,}",
                f"{o.seconds:.2f}",
                f"{row.tokens_per_s:,.0f}",
                f"{o.percentile(0.5):.1f} / {o.percentile(0.99):.1f}",
                f"{100 * o.server_cpu_s / o.seconds:.0f}",
                f"{target}{' (errors)' if o.errors else ''}",
            ]
        )
    return markdown_table(header, cells)


# --- main -------------------------------------------------------------------------------------------------------


@dataclass
class TransportFloor:
    """The two transports alone, on the same Kafka and Redis, at the same pace as one request each."""

    kafka_ms: list[float]
    redis_ms: list[float]

    def p(self, q: float) -> tuple[float, float, float]:
        kafka, redis = percentile(self.kafka_ms, q), percentile(self.redis_ms, q)
        return kafka, redis, kafka + redis


async def measure_transport_floor(settings: Settings, *, messages: int, rate: float) -> TransportFloor:
    """What the broker and the stream cost with nothing else in the way: one record produced as ingress does
    (``acks=all``, idempotent) until a consumer polling as the worker does holds it, and one XADD until a
    blocked XREAD has it; ``messages`` of each at ``rate`` per second."""
    import redis.asyncio as aioredis

    from sluicegate.kafka import create_consumer, create_producer, ensure_topics

    topic = f"{settings.topic_prefix}floor.{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings.kafka_bootstrap, {topic: 1}, settings.topic_replication)
    producer = create_producer(settings, client_id="floor-producer")
    consumer = create_consumer(topic, group_id=None, settings=settings, client_id="floor-consumer")
    redis_w, redis_r = aioredis.Redis.from_url(settings.redis_url), aioredis.Redis.from_url(settings.redis_url)
    await producer.start()
    await consumer.start()
    sent: dict[bytes, float] = {}
    kafka_ms: list[float] = []
    redis_ms: list[float] = []
    stream = f"{settings.topic_prefix}floor:{uuid.uuid4().hex[:8]}"

    async def consume() -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batch.values():
                for record in records:
                    if record.value in sent:
                        kafka_ms.append(1000 * (now - sent[record.value]))

    async def read_stream() -> None:
        last = "$"
        while True:
            reply = await redis_r.xread({stream: last}, block=1000)
            now = time.perf_counter()
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    redis_ms.append(1000 * (now - float(fields[b"t"])))

    readers = [asyncio.create_task(consume()), asyncio.create_task(read_stream())]
    try:
        await asyncio.sleep(1.0)  # both readers parked: the consumer at the log end, XREAD blocked
        for i in range(messages):
            value = f"floor-{i}".encode()
            sent[value] = time.perf_counter()
            await (await producer.send(topic, value, key=value))
            await asyncio.sleep(1 / (2 * rate))
            await redis_w.xadd(stream, {"t": repr(time.perf_counter())})
            await asyncio.sleep(1 / (2 * rate))
        await asyncio.sleep(0.5)
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await consumer.stop()
        await producer.stop()
        await redis_w.delete(stream)
        await redis_w.aclose()
        await redis_r.aclose()
    return TransportFloor(kafka_ms, redis_ms)


def floor_table(floor: TransportFloor, levels: Sequence[Level]) -> str:
    (k50, r50, t50), (k99, r99, t99) = floor.p(0.5), floor.p(0.99)
    rows = [
        ["Kafka: produce (acks=all) -> consumer holds it", str(len(floor.kafka_ms)), fmt(k50), fmt(k99)],
        ["Redis: XADD -> blocked XREAD has it", str(len(floor.redis_ms)), fmt(r50), fmt(r99)],
        ["sum: the transport floor of one request", "", fmt(t50), fmt(t99)],
    ]
    runs: dict[float, int] = {}
    for level in levels:
        overhead = level.series.get("overhead", [])
        o50, o99 = percentile(overhead, 0.5), percentile(overhead, 0.99)
        runs[level.rate] = runs.get(level.rate, 0) + 1
        which = f" (run {runs[level.rate]} at this rate)" if runs[level.rate] > 1 else ""
        label = f"pipeline overhead at {level.rate:g} req/s{which}, as a multiple of the floor"
        rows.append([label, "", f"{fmt(o50 / t50)}x", f"{fmt(o99 / t99)}x"])
    return markdown_table(["transport alone", "samples", "p50 ms", "p99 ms"], rows)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_relay(stack: Stack, args: argparse.Namespace) -> list[RelayRow]:
    """``benchmarks.relay``'s max-mode scenario against the pipeline's own result service."""
    rows = []
    pid = stack.services["result-service"].pid
    for clients in (int(c) for c in args.relay_clients.split(",") if c.strip()):
        streams = max(1, clients // args.clients_per_stream)
        scenario = relay.Scenario("max", clients, streams, args.relay_tokens, args.relay_batch, 0.0)
        _progress(f"relay: {clients} clients on {streams} streams, {args.relay_tokens} tokens each ...")
        settings = stack.settings
        outcome = asyncio.run(
            relay.run_scenario(
                scenario, settings.redis_url, stack.result_url, pid, settings.topic_prefix, args.client_procs
            )
        )
        for error in outcome.errors[:5]:
            _progress(f"  relay error: {error}")
        rows.append(RelayRow(outcome))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kafka-bootstrap", help="use this Kafka (with --redis-url) instead of a private dev stack")
    parser.add_argument("--redis-url", help="use this Redis (with --kafka-bootstrap)")
    parser.add_argument("--kafka-port", type=int, default=DEFAULT_KAFKA_PORT, help="private stack's Kafka port")
    parser.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT, help="private stack's Redis port")
    parser.add_argument("--rates", default="10,50,100", help="comma-separated arrival rates (requests/s)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    parser.add_argument("--max-tokens", type=int, default=8)
    # A production broker runs C2-compiled code; C2 needs thousands of requests through the path before it has
    # compiled it (with 20 s at 10 req/s its compiler was still busy while 50 req/s was measured).
    parser.add_argument(
        "--broker-jit",
        choices=("full", "c1"),
        default="full",
        help="JIT of the private broker: full (C2, as in production) or c1 (the dev stack's fast start)",
    )
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of warm-up load before measuring")
    parser.add_argument("--warmup-rate", type=float, default=100.0, help="requests/s of the warm-up load")
    parser.add_argument("--partitions", type=int, default=Settings().topic_partitions, help="partitions per topic")
    parser.add_argument("--relay-clients", default="100,500", help="comma-separated relay client counts; empty: none")
    parser.add_argument("--clients-per-stream", type=int, default=10)
    parser.add_argument("--relay-tokens", type=int, default=2000, help="token events per relayed stream")
    parser.add_argument("--relay-batch", type=int, default=20, help="events per stream per producer pipeline")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the relay clients are spread over")
    parser.add_argument("--log-level", default="WARNING", help="log level of the services")
    parser.add_argument(
        "--floor-messages", type=int, default=300, help="messages per transport for the floor (0: skip it)"
    )
    parser.add_argument(
        "--engine",
        choices=("process", "thread"),
        default="process",
        help="the worker's engine: child process or thread",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (service logs, model)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if any(r <= 0 for r in rates) or args.duration <= 0 or args.max_tokens < 1:
        parser.error("rates and --duration must be positive and --max-tokens at least 1")

    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    stack = start_stack(args, workdir)
    levels: list[Level] = []
    relay_rows: list[RelayRow] = []
    floor: TransportFloor | None = None
    load_before = _load_average()
    try:
        if args.warmup > 0:
            _progress(f"warm-up: {args.warmup:g} s at {args.warmup_rate:g} req/s ...")
            asyncio.run(
                run_rate(
                    stack, args.warmup_rate, args.warmup, max_tokens=args.max_tokens, seed=args.seed, label="warm "
                )
            )
        for rate in rates:
            _progress(f"{rate:g} req/s for {args.duration:g} s ...")
            before, cpu_before = asyncio.run(ingress_timers(stack)), cpu_seconds(stack.pids())
            samples = asyncio.run(run_rate(stack, rate, args.duration, max_tokens=args.max_tokens, seed=args.seed))
            after, cpu_after = asyncio.run(ingress_timers(stack)), cpu_seconds(stack.pids())
            stack.check_alive()
            level = Level(rate, args.duration, samples)
            level.cpu_ms = {
                name: 1000 * (cpu_after[name] - cpu_before[name]) / max(1, len(samples))
                for name in cpu_after
                if name in cpu_before
            }
            level.publish_mean_ms, level.handler_mean_ms = (
                1000 * (after[k][0] - before[k][0]) / max(1, after[k][1] - before[k][1]) for k in ("publish", "handler")
            )
            levels.append(level)
            done = [s for s in samples if s.first and s.error is None]
            e2e = [1000 * (s.first - s.sent) for s in done]
            _progress(f"  {len(done)}/{len(samples)} streamed; e2e TTFT p50 {fmt(percentile(e2e, 0.5))} ms")
        recorded = stack.stop_worker()
        for level in levels:
            analyse(level, recorded["stamps"])
        if rates and not recorded["probes"]:
            _progress("the worker's private hooks were not found: no stage split")
        if args.floor_messages > 0:
            _progress(f"transport floor: {args.floor_messages} Kafka records and stream entries at 50/s ...")
            floor = asyncio.run(measure_transport_floor(stack.settings, messages=args.floor_messages, rate=50))
        if args.relay_clients.strip():
            relay_rows = run_relay(stack, args)
    finally:
        stack.close()
        if args.keep:
            _progress(f"logs and model kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"\npipeline benchmark on {os.cpu_count()} CPUs (Kafka, Redis, services, worker and clients share them); "
        f"load average before: {load_before}"
    )
    print(
        f"model: tiny random Llama (2 layers, hidden 64) on CPU, 1 torch thread; prompts ~8 tokens, "
        f"max_tokens {args.max_tokens}, greedy; Poisson arrivals, {args.duration:g} s per rate; "
        f"{args.partitions} partitions per topic; service log level {args.log_level}"
    )
    if levels:
        print(
            "overhead = (first token on the WebSocket - POST sent) - engine TTFT, where the engine TTFT "
            "(first_token_time - arrival_time of the request's RequestMetrics) is recorded worker-side, "
            "per request, by the worker under test\n"
        )
        print(latency_table(levels))
        print("\nwhere the overhead goes (stages add up to it; see the module docstring):\n")
        print(stage_table(levels))
        print("\nCPU milliseconds per request, by process (clients: this script's load generator):\n")
        print(cpu_table(levels))
        for level in levels:
            if level.errors or level.unmatched:
                print(f"\n{level.rate:g} req/s: {len(level.errors)} failed, {level.unmatched} without worker timing")
                for error in sorted(set(level.errors))[:5]:
                    print(f"  {error}")
    if floor is not None:
        print("\nthe transports alone, same Kafka and Redis, after the rates (the floor any broker pipeline pays):\n")
        print(floor_table(floor, levels))
    if relay_rows:
        print("\nrelay throughput (benchmarks.relay, max mode, against this pipeline's result service):\n")
        print(relay_table(relay_rows))
    failed = any(level.errors for level in levels) or any(row.outcome.errors for row in relay_rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
