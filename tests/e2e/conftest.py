"""End-to-end harness: the real services as subprocesses on real Kafka and Redis.

Each test module gets its own topic/key prefix and ports; workers are separate processes so tests
can ``kill -9`` them. The tiny random-weight model is built once per session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from ports import free_port

API_KEY = "sk-e2e-test-key"
MODEL_NAME = "tiny-e2e"
REPO_MODELS = Path(__file__).resolve().parents[2] / ".sluicegate" / "models"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME, arch="llama", num_layers=2, hidden_size=64)


@pytest.fixture(scope="session")
def paced_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger random model (6 layers, hidden 384: ~5 ms a token on one idle CPU core) for tests that must act
    while a request is mid-generation; such a module overrides ``tiny_model_dir`` to return this one."""
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "paced", arch="llama", num_layers=6, hidden_size=384)


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    """Extra environment for every service of a module's pipeline; a test module overrides it."""
    return {}


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class Pipeline:
    """Handles to a running pipeline and helpers to drive it."""

    env: dict[str, str]
    log_dir: Path
    ingress_url: str
    result_url: str
    prefix: str
    redis_url: str
    kafka_bootstrap: str
    services: list[Service] = field(default_factory=list)
    api_key: str = API_KEY
    model: str = MODEL_NAME
    #: Per subcommand (``ingress``, ``worker``...), environment only that service gets (its own Redis user).
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    _redis: Any = None

    def start(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> Service:
        log_path = self.log_dir / f"{name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", *args],
            env={**self.env, **self.service_env.get(args[0], {}), **(extra_env or {})},
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        service = Service(name, process, log_path)
        self.services.append(service)
        return service

    def start_worker(self, name: str = "worker", **extra_env: str) -> Service:
        return self.start(name, "worker", extra_env={"SLUICEGATE_WORKER_ID": name, **extra_env})

    def kill(self, service: Service, sig: int = signal.SIGKILL) -> None:
        if service.alive():
            os.kill(service.process.pid, sig)
        service.process.wait(timeout=60)

    def start_batch_worker(self, name: str = "batch-worker") -> Service:
        """A Celery worker running batches' lives (``sluicegate batch-worker``), as a supervisor starts one."""
        return self.start(name, "batch-worker")

    def kill_group(self, service: Service) -> None:
        """``kill -9`` a service and every process it started (a Celery worker's pool children too), as when
        its machine or container dies."""
        if service.alive():
            os.killpg(service.process.pid, signal.SIGKILL)
        service.process.wait(timeout=60)

    def openai(self, **options: Any) -> Any:
        """An official ``openai`` SDK client on ingress, with the pipeline's API key."""
        from openai import OpenAI

        return OpenAI(base_url=f"{self.ingress_url}/v1", api_key=self.api_key, **options)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_http(self, url: str, service: Service, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert service.alive(), f"{service.name} died:\n{service.log()}"
            try:
                if httpx.get(url, timeout=1).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{service.name} not up at {url}:\n{service.log()}")

    def wait_workers(self, count: int = 1, timeout_s: float = 90) -> None:
        """Until ``count`` workers heartbeat (so they joined the group and own partitions)."""
        import redis

        from schemas import Names, WorkerHeartbeat

        client = redis.Redis.from_url(self.redis_url)
        key = Names(self.prefix).workers_key(self.model)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                beats = [WorkerHeartbeat.model_validate_json(v) for v in client.hgetall(key).values()]
                fresh = [b for b in beats if b.partitions and time.time() - b.sent_at.timestamp() < 10]
                if len(fresh) >= count and sum(len(b.partitions) for b in fresh) >= 3:
                    return
                time.sleep(0.3)
        finally:
            client.close()
        logs = "\n".join(s.log() for s in self.services if s.name.startswith("worker"))
        raise AssertionError(f"fewer than {count} workers heartbeating:\n{logs}")

    # --- helpers for fault tests --------------------------------------------------------------------
    def redis(self) -> Any:
        """A synchronous Redis client on the pipeline's server (shared, closed by ``stop_all``)."""
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.redis_url)
        return self._redis

    def find(self, name: str) -> Service:
        """The most recently started service called ``name``."""
        return next(s for s in reversed(self.services) if s.name == name)

    def submit(self, **body: Any) -> dict[str, Any]:
        """``POST /v1/requests`` (the model is filled in); returns the 202 body (request_id, stream_url...)."""
        response = httpx.post(
            f"{self.ingress_url}/v1/requests", json={"model": self.model, **body}, headers=self.headers(), timeout=30
        )
        assert response.status_code == 202, response.text
        return response.json()

    def stream_events(self, request_id: str) -> list[Any]:
        """The request's stream events as the worker appended them (parsed contracts)."""
        from schemas import STREAM_FIELD, Names, parse_stream_event

        entries = self.redis().xrange(Names(self.prefix).stream_key(request_id))
        return [parse_stream_event(fields[STREAM_FIELD.encode()]) for _, fields in entries]

    def wait_stream_end(self, request_id: str, timeout_s: float = 60) -> list[Any]:
        """The stream's events once it holds ``done`` or ``error``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = self.stream_events(request_id)
            if events and events[-1].type in ("done", "error"):
                return events
            time.sleep(0.05)
        events = self.stream_events(request_id)
        raise AssertionError(f"stream of {request_id} did not end within {timeout_s}s: {events[-3:]}")

    def record(self, request_id: str) -> Any:
        """The request's status record (``RequestRecord``), or None."""
        from schemas import Names, RequestRecord

        raw = self.redis().get(Names(self.prefix).request_key(request_id))
        return None if raw is None else RequestRecord.model_validate_json(raw)

    def wait_record(self, request_id: str, status: str, timeout_s: float = 15) -> Any:
        """The request's status record once it says ``status``: a worker writes the end status after the stream's
        ``done`` (once the result and usage records are in Kafka), so a test that saw the stream end waits for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.record(request_id)
            if record is not None and record.status == status:
                return record
            if time.monotonic() > deadline:
                raise AssertionError(f"record of {request_id} is {record!r}, not {status!r}, after {timeout_s}s")
            time.sleep(0.02)

    def heartbeats(self) -> dict[str, Any]:
        """Worker id -> latest ``WorkerHeartbeat`` of the pipeline's model."""
        from schemas import Names, WorkerHeartbeat

        raw = self.redis().hgetall(Names(self.prefix).workers_key(self.model))
        return {k.decode(): WorkerHeartbeat.model_validate_json(v) for k, v in raw.items()}

    def stop_all(self) -> None:
        for service in reversed(self.services):
            if service.alive():
                service.process.send_signal(signal.SIGTERM)
        for service in self.services:
            try:
                service.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                service.process.kill()
        if self._redis is not None:
            self._redis.close()
            self._redis = None


#: Pipelines running in this process now, whose service logs a failing test's report carries.
_RUNNING: list[Pipeline] = []
#: How much of each service's log a failure report shows (the files themselves stay under pytest's basetemp).
REPORT_LOG_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report ends with the tail of every running service's log: CI keeps only its output, and
    a pipeline's failure (a stall, a lost request) is usually told only by what the services logged."""
    report = yield
    if report.failed and report.when in ("setup", "call"):
        for pipe in _RUNNING:
            for path in sorted(pipe.log_dir.glob("*.log")):
                lines = path.read_text(errors="replace").splitlines()[-REPORT_LOG_LINES:]
                report.sections.append((f"service log {path.name} (last {len(lines)} lines)", "\n".join(lines)))
    return report


@contextlib.contextmanager
def running_pipeline(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    extra_env: dict[str, str],
    model_name: str = MODEL_NAME,
    prefix: str | None = None,
    service_env: dict[str, dict[str, str]] | None = None,
) -> Iterator[Pipeline]:
    """Router, ingress, result service and one worker serving ``model_dir`` as ``model_name``, under a prefix of
    their own (plus ``extra_env``, and ``service_env`` per subcommand); stopped on exit."""
    prefix = prefix or f"e{uuid.uuid4().hex[:8]}."
    ingress_port, result_port = free_port(), free_port()
    env = {
        **os.environ,
        "SLUICEGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "SLUICEGATE_REDIS_URL": redis_url,
        "SLUICEGATE_TOPIC_PREFIX": prefix,
        "SLUICEGATE_TOPIC_PARTITIONS": "2",
        "SLUICEGATE_API_KEYS": API_KEY,
        "SLUICEGATE_STREAM_TOKEN_SECRET": uuid.uuid4().hex,
        "SLUICEGATE_MODEL": str(model_dir),
        "SLUICEGATE_MODEL_NAME": model_name,
        "SLUICEGATE_INGRESS_PORT": str(ingress_port),
        "SLUICEGATE_RESULT_PORT": str(result_port),
        "SLUICEGATE_PUBLIC_STREAM_URL": f"ws://127.0.0.1:{result_port}",
        "SLUICEGATE_HEARTBEAT_INTERVAL_S": "0.5",
        "SLUICEGATE_KV_CACHE_GB": "0.05",
        "SLUICEGATE_LOG_LEVEL": "INFO",
        # Several pipelines (and workers) share this host: no fixed metrics ports unless a module asks for them.
        "SLUICEGATE_WORKER_METRICS_PORT": "0",
        "SLUICEGATE_ROUTER_METRICS_PORT": "0",
        "SLUICEGATE_BATCH_METRICS_PORT": "0",
        # Uploaded and batch output files: one folder that ingress and the batch workers share.
        "SLUICEGATE_FILES_URL": str(tmp_path_factory.mktemp("files")),
        **extra_env,
    }
    log_dir = tmp_path_factory.mktemp("pipeline-logs")
    pipe = Pipeline(
        env=env,
        log_dir=log_dir,
        ingress_url=f"http://127.0.0.1:{ingress_port}",
        result_url=f"http://127.0.0.1:{result_port}",
        prefix=prefix,
        redis_url=redis_url,
        kafka_bootstrap=kafka_bootstrap,
        model=model_name,
        service_env=service_env or {},
    )
    _RUNNING.append(pipe)
    try:
        pipe.start_worker("worker-a")
        router = pipe.start("router", "router")
        ingress = pipe.start("ingress", "ingress")
        results = pipe.start("result-service", "result-service")
        pipe.wait_http(f"{pipe.ingress_url}/healthz", ingress)
        pipe.wait_http(f"{pipe.result_url}/healthz", results)
        pipe.wait_workers(1, timeout_s=240)
        assert router.alive(), router.log()
        yield pipe
    finally:
        _RUNNING.remove(pipe)
        pipe.stop_all()


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str,
    redis_url: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    pipeline_env: dict[str, str],
) -> Iterator[Pipeline]:
    """Router, ingress, result service and one worker, under a prefix of their own (plus ``pipeline_env``)."""
    with running_pipeline(kafka_bootstrap, redis_url, tiny_model_dir, tmp_path_factory, pipeline_env) as pipe:
        yield pipe


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model, SmolLM2-135M-Instruct's GGUF, fetched once into the repository's
    ``.sluicegate/models`` (the cache ``sluicegate up`` and ``run.sh test`` use), so a CI run downloads it once."""
    from sluicegate.models.smollm2 import fetch_smollm2

    return fetch_smollm2(REPO_MODELS)


@pytest.fixture(scope="module")
def real_pipeline(
    kafka_bootstrap: str, redis_url: str, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """A pipeline serving the real default model as ``sluicegate up`` does: its public name and its dtype."""
    from cli.stack.launcher import DEFAULT_MODEL_NAME, default_model_dtype, default_model_quantization

    # Several prompts at once (the structured-output test) share the engine's batch; the default KV budget of the
    # tiny model is too small for a 135M model's longer prompts. The cache holds at least one request of the model's
    # whole context (8192 tokens), and its entries take the model's dtype: 0.17 GiB of bfloat16, 0.35 of float32 (the
    # dtype ``up`` picks on a CPU with neither bf16 instructions nor AVX2).
    dtype = default_model_dtype()
    env = {
        "SLUICEGATE_DTYPE": dtype,
        "SLUICEGATE_QUANTIZATION": default_model_quantization(dtype),
        "SLUICEGATE_KV_CACHE_GB": "0.3" if dtype == "bfloat16" else "0.6",
    }
    with running_pipeline(
        kafka_bootstrap, redis_url, smollm2_path, tmp_path_factory, env, model_name=DEFAULT_MODEL_NAME
    ) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def batch_worker(pipeline: Pipeline) -> Service:
    """A Celery batch worker beside the module's pipeline (tasks wait in the Redis broker until it consumes)."""
    service = pipeline.start_batch_worker()
    time.sleep(1.0)
    assert service.alive(), service.log()
    return service
