"""``sluicegate worker``: builds the engine and the Kafka/Redis clients, runs a :class:`Worker`.

SIGTERM (or Ctrl-C) drains: no new requests, in-flight ones finish (bounded), offsets are committed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gpu_workers.engine import AsyncEngine, EngineFront, ProcessEngine
from gpu_workers.engine.models.loader import resolve_model_path
from schemas import TIERS, Names
from sluicegate import event_loop
from sluicegate.gc_freeze import freeze_startup_heap
from sluicegate.kafka import create_consumer, create_producer, ensure_topics
from sluicegate.logs import configure_logging
from sluicegate.lora.registry import LoRARegistry
from sluicegate.metrics_http import MetricsServer
from sluicegate.models.naming import default_public_name
from sluicegate.redis_client import create_redis
from sluicegate.redis_urls import is_sentinel_url
from sluicegate.settings import WorkerSettings
from sluicegate.telemetry import configure_tracing, shutdown_tracing, tracing_enabled

from .adapters import Adapters
from .config import WorkerConfig
from .control import control_topics
from .kv_tiers import kv_offload_config
from .observer import WorkerObserver
from .telemetry import WorkerTelemetry
from .worker import Worker

log = logging.getLogger(__name__)

# Default lookahead in engine seats: enough queued behind the running sequences that another tenant's requests
# behind a flood on the same partition reach the engine's fair queue while most of the flood is still waiting.
LOOKAHEAD_SEATS = 4
#: Records held past what runs, in lookaheads: a backlog up to about this deep ahead of a tenant in Kafka is shared
#: by tokens (benchmarks.tenant_fairness at 2x overload, a backlog of 8 lookaheads: a hold of 8 kept B's tokens / A's
#: at 1.02, 4 at 0.54, 1 at 0.23; a deeper backlog outgrows any hold, docs/benchmarks.md). Records are a few KB, so
#: the 2048 held by a 64-seat worker stay far below its memory; a crash re-delivers them (they were never committed).
HOLD_LOOKAHEADS = 8


def model_name_for(settings: WorkerSettings) -> str:
    """The public model name: configured, else the model folder's name (a GGUF file's stem, lower-cased)."""
    return settings.model_name or default_public_name(settings.model)


def lora_enabled(settings: WorkerSettings) -> bool:
    """Whether the worker serves LoRA adapters: asked for, or implied by adapters named at start."""
    return settings.enable_lora or bool(settings.worker_loras)


def engine_arguments(settings: WorkerSettings) -> dict[str, object]:
    """``EngineConfig`` fields from the worker's settings."""
    lora: dict[str, object] = {}
    if lora_enabled(settings):  # left out otherwise: the engine's defaults (LoRA off)
        lora = dict(
            enable_lora=True,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            max_cpu_loras=settings.max_cpu_loras or None,
        )
    return lora | dict(
        device=settings.device,
        dtype=settings.dtype,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        stream_interval_ms=settings.stream_interval_ms,
        lower_tier_max_batched_tokens=(settings.device == "cpu" and settings.lower_tier_max_batched_tokens) or None,
        cpu_kv_cache_gb=settings.kv_cache_gb,
        attention_backend=settings.attention_backend,
        quantization=settings.quantization or None,
        kv_cache_dtype=settings.kv_cache_dtype,
        tenant_weights=dict(settings.tenant_weights),
        block_size=settings.block_size,
        enable_kv_events=settings.kv_events and settings.enable_prefix_caching,
        kv_offload=kv_offload_config(settings),
        enable_prefix_caching=settings.enable_prefix_caching,
        enable_cascade_attention=settings.enable_cascade_attention,
        enforce_eager=settings.enforce_eager,
        compile_cpu_decode=settings.compile_cpu_decode,
        lm_head_quantization=settings.lm_head_quantization or None,
        cpu_int4_activations=settings.cpu_int4_activations,
        cpu_prefill_threads=settings.cpu_prefill_threads,  # the engine ignores it off the CPU
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_model_len=settings.max_model_len or None,
        deterministic=settings.deterministic,
        tensor_parallel_size=settings.tensor_parallel_size,
        speculative_config=(
            dict(
                method=settings.speculative_method,
                num_speculative_tokens=settings.num_speculative_tokens,
                prompt_lookup_min=settings.speculative_prompt_lookup_min,
                prompt_lookup_max=settings.speculative_prompt_lookup_max,
                model=settings.speculative_model or None,
            )
            if settings.speculative_method
            else None
        ),
    )


def prepare_engine_process(log_level: str, log_format: str, torch_threads: int, niceness: int = 0) -> None:
    """Runs in the engine's process before the model loads: the worker's log format, its torch threads, and
    its scheduling priority."""
    configure_logging(log_level, log_format)
    set_torch_threads(torch_threads)
    if niceness:
        os.nice(niceness)


def set_torch_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def engine_in_process(settings: WorkerSettings) -> bool:
    """Whether the worker's engine runs in a child process (``SLUICEGATE_ENGINE_MODE``; ``auto`` is a process).

    In a process the step loop's Python (scheduling, input preparation, kernel launches) never holds the GIL
    that the worker's Kafka and Redis I/O needs. ``thread`` keeps everything in one process (one model load,
    no engine process to supervise); on the 2-core pipeline benchmark the two measured the same overhead and
    the process about 1 ms less time to first token (docs/benchmarks.md).
    """
    return settings.engine_mode != "thread"


def engine_process_env(settings: WorkerSettings) -> dict[str, str]:
    """What a CPU engine's process adds to its environment: the OpenMP wait policy (``engine_cpu_wait_policy``)
    unless the environment sets one. With torch's default (spinning) two threads on two cores shared with the
    worker, Kafka and Redis stall at every parallel op whose peer was preempted; on a busy 2-core box a passive
    wait took a batch-1 step of the default model from 797-1,791 ms to 24-29 ms. On an idle box spinning decodes
    1.3-1.5x faster through ``up``; ``inherit`` keeps it (docs/benchmarks.md, OpenMP threads on shared cores)."""
    policy = settings.engine_cpu_wait_policy
    if settings.device != "cpu" or policy == "inherit" or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": policy.upper()}


def build_engine(settings: WorkerSettings) -> EngineFront:
    """The worker's engine, not started: a child process or a thread of this process (see ``engine_in_process``)."""
    if engine_in_process(settings):
        # A CPU engine shares the cores with the worker's I/O, Redis and the relay, which carry tokens already
        # made: at a lower priority its steps give way to them (paired 2-core runs: overhead p50 5.8, 6.3 ->
        # 5.5, 5.7 ms). A CUDA engine keeps full priority: its steps feed the GPU.
        niceness = settings.engine_cpu_nice if settings.device == "cpu" else 0
        prepare = partial(
            prepare_engine_process, settings.log_level, settings.log_format, settings.torch_threads, niceness
        )
        return ProcessEngine(
            settings.model,
            initializer=prepare,
            env=engine_process_env(settings),
            **engine_arguments(settings),  # type: ignore[arg-type]
        )
    set_torch_threads(settings.torch_threads)
    return AsyncEngine(settings.model, **engine_arguments(settings))  # type: ignore[arg-type]


async def run_worker(
    settings: WorkerSettings,
    stop: asyncio.Event,
    engine: EngineFront | None = None,
    *,
    freeze_heap: bool = False,
    observer: WorkerObserver | None = None,
) -> Worker:
    """Run one worker until ``stop`` is set; returns it (for its counters) after draining. ``freeze_heap``
    (for a process that is only this worker) takes the model and libraries out of the garbage collector's
    passes once they are loaded; ``observer`` is told when records are taken and events sent."""
    names = settings.names
    model_name = model_name_for(settings)
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    configure_tracing("sluicegate-worker", settings.otlp_endpoint)
    engine = engine or build_engine(settings)
    telemetry = None
    if settings.metrics_enabled or tracing_enabled():  # the request span lives in the telemetry too
        telemetry = WorkerTelemetry(
            engine,
            model_name,
            worker_id,
            queue_budget_s=settings.default_queue_budget_s,
            max_num_seqs=settings.max_num_seqs,
        )
    # Up before the model loads: liveness answers during a long load, readiness says why it is not ready yet.
    probes = _Probes()
    server = await _start_metrics(settings, telemetry, probes)
    try:
        # Started first: the worker needs its tokenizer, and a model that cannot load should fail before the
        # worker joins a consumer group.
        await engine.start()
        log.info(
            "worker.engine_ready",
            extra={
                "engine": type(engine).__name__,
                "engine_pid": getattr(engine, "pid", None) or os.getpid(),
                "architecture": engine.architecture,
            },
        )
        try:
            return await _run_started(
                settings, stop, engine, names, model_name, worker_id, freeze_heap, observer, telemetry, probes
            )
        finally:
            await engine.shutdown()
    finally:
        if server is not None:
            await server.close()


class _Probes:
    """What ``/readyz`` asks: the worker once it exists, else why not yet."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def __call__(self) -> tuple[bool, str]:
        if self.worker is None:
            return False, "engine loading"
        return self.worker.readiness()


async def _start_metrics(
    settings: WorkerSettings, telemetry: WorkerTelemetry | None, probes: _Probes
) -> MetricsServer | None:
    if not settings.worker_metrics_port:
        return None
    # Metrics off: the probes still answer, over an empty registry.
    registry = telemetry.registry if telemetry is not None else CollectorRegistry()
    server = MetricsServer(registry, settings.worker_metrics_port, ready=probes)
    try:
        await server.start()
    except OSError as exc:  # a second worker on one host: it serves, unobserved, rather than not at all
        log.warning("worker.metrics_port_unavailable", extra={"port": settings.worker_metrics_port, "error": str(exc)})
        return None
    return server


async def _run_started(
    settings: WorkerSettings,
    stop: asyncio.Event,
    engine: EngineFront,
    names: Names,
    model_name: str,
    worker_id: str,
    freeze_heap: bool,
    observer: WorkerObserver | None,
    telemetry: WorkerTelemetry | None,
    probes: _Probes,
) -> Worker:
    if freeze_heap:
        freeze_startup_heap("worker")
    lookahead = settings.worker_lookahead or LOOKAHEAD_SEATS * settings.max_num_seqs
    config = WorkerConfig(
        model_name=model_name,
        model_description=settings.model_description,
        reasoning_parser=settings.reasoning_parser,
        worker_id=worker_id,
        max_in_flight=lookahead,
        intake_hold=settings.worker_intake_hold or HOLD_LOOKAHEADS * lookahead,
        tenant_weights=dict(settings.tenant_weights),
        lower_tier_in_flight_while_busy=settings.worker_lower_tier_lookahead_busy if settings.device == "cpu" else 0,
        batch_rate_while_busy=settings.worker_batch_rate_busy if settings.device == "cpu" else 0.0,
        busy_window_s=settings.worker_busy_window_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        stream_ttl_s=settings.stream_ttl_s,
        drain_timeout_s=settings.drain_timeout_s,
        session_timeout_ms=settings.worker_session_timeout_ms,
        heartbeat_ms=max(300, settings.worker_session_timeout_ms // 4),
        device=settings.device,
        deterministic=settings.deterministic,
        commit_interval_s=settings.worker_commit_interval_s,
        metrics=telemetry is not None,
        replica_ack=is_sentinel_url(settings.redis_url)
        if settings.worker_replica_ack is None
        else settings.worker_replica_ack,
        replica_ack_max_events=settings.worker_replica_ack_max_events,
        reader_lease_s=settings.reader_lease_s,
        tenants=settings.tenant_names,
        kv_events=settings.kv_events and settings.enable_prefix_caching,
    )
    topics = {t: settings.topic_partitions for t in names.request_topics(model_name)}
    controls = control_topics(names, config.tenants)
    topics |= {
        names.results_topic: settings.topic_partitions,
        names.usage_topic: settings.topic_partitions,
        names.dlq_topic: 1,
        names.heartbeats_topic: 1,
        names.kv_events_topic: settings.topic_partitions,  # keyed by worker: each worker's events stay in order
        **dict.fromkeys(controls, 1),
    }
    for tenant in config.tenants if names.tenants_apart else ():  # each tenant's results and dead letters
        topics |= {names.results_topic_of(tenant): settings.topic_partitions, names.dlq_topic_of(tenant): 1}
    await ensure_topics(settings.kafka_bootstrap, topics, settings.topic_replication, settings=settings)

    # A read timeout (the worker never blocks on Redis) turns a hung server into an error that is retried.
    redis = create_redis(
        settings, socket_timeout=settings.worker_redis_timeout_s, client_name=f"worker-{config.worker_id}"
    )
    # Stream appends with replica_ack go through a client that never retries a pipeline behind the publisher's
    # back: a failed flush must reach the publisher, which re-appends what no replica acknowledged first.
    stream_redis = (
        create_redis(
            settings,
            socket_timeout=settings.worker_redis_timeout_s,
            client_name=f"worker-{config.worker_id}-streams",
            retries=0,
        )
        if config.replica_ack
        else None
    )
    producer = create_producer(settings, client_id=f"worker-{config.worker_id}")
    consumer = create_consumer(
        group_id=names.worker_group(model_name),
        settings=settings,
        client_id=f"worker-{config.worker_id}",
        session_timeout_ms=config.session_timeout_ms,
        heartbeat_interval_ms=config.heartbeat_ms,
        max_poll_interval_ms=300_000,
        # A full tier's partitions are paused, and aiokafka drops what it had prefetched for them; once
        # resumed they are fetched again only after the fetch in flight returns, which the broker holds
        # for up to this long when the other partitions are empty (default 500 ms: seen as a 0.6 s stall
        # of the next request in line). Idle, this costs ten small fetches a second.
        fetch_max_wait_ms=100,
    )
    # Cancels go to every worker: no group, start at the end (older cancels are in Redis keys).
    control = create_consumer(
        *controls,
        group_id=None,
        settings=settings,
        auto_offset_reset="latest",
        client_id=f"worker-control-{config.worker_id}",
    )
    adapters = None
    if lora_enabled(settings):
        adapters = build_adapters(settings, engine, redis, names, model_name)
        # Before joining the group: a worker told to serve an adapter it cannot load fails here, with the reason.
        await adapters.preload(settings.worker_loras)
    worker = Worker(
        engine,
        config,
        names=names,
        redis=redis,
        producer=producer,
        consumer=consumer,
        control_consumer=control,
        observer=observer,
        telemetry=telemetry,
        stream_redis=stream_redis,
        adapters=adapters,
    )
    probes.worker = worker
    await producer.start()
    await control.start()
    consumer.subscribe(names.request_topics(model_name), listener=worker.rebalance_listener())
    log.info(
        "worker.started",
        extra={"worker_id": config.worker_id, "model": model_name, "tiers": ",".join(TIERS), "device": settings.device},
    )
    try:
        await worker.run(stop, start_consumer=True)
    finally:
        await consumer.stop()
        await control.stop()
        await producer.stop()
        await redis.aclose()
        if stream_redis is not None:
            await stream_redis.aclose()
        log.info("worker.stopped", extra={"worker_id": config.worker_id, "served": worker.served})
    return worker


def build_adapters(
    settings: WorkerSettings, engine: EngineFront, redis: Redis, names: Names, model_name: str
) -> Adapters:
    """The worker's LoRA adapters: registry in Redis, fetched copies under ``lora_cache_dir``."""
    cache_dir = Path(settings.lora_cache_dir) if settings.lora_cache_dir else settings.state_dir / "lora-cache"
    return Adapters(
        engine,
        LoRARegistry(redis, names.prefix),
        model_name=model_name,
        cache_dir=cache_dir,
        max_lora_rank=settings.max_lora_rank,
        model_config=partial(model_config, settings.model),
        # As long as ingress and the router reuse their registry snapshot: an unload is seen everywhere within it.
        lookup_ttl_s=settings.lora_cache_ttl_s,
    )


def model_config(model: str) -> Any:
    """The served model's Hugging Face config, which adapters are checked against (blocking: reads files)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(resolve_model_path(model)))


def serve_worker(settings: WorkerSettings | None = None) -> NoReturn:
    """Blocking entry point for the CLI; after a clean stop it ends the process (status 0) itself. Without
    ``settings``, the worker's own (:class:`WorkerSettings`) are read from the environment."""
    own = settings or WorkerSettings()

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_worker(own, stop, freeze_heap=True)

    # uvloop: the worker's loop is all I/O hops (fetch, engine hand-off, Redis); paired pipeline runs at 50 req/s
    # measured overhead p50 5.9, 5.8 -> 5.6, 5.4 ms and worker CPU 4.4 -> 4.0-4.1 ms per request.
    event_loop.run(_main())
    shutdown_tracing()  # os._exit skips atexit: export the last spans now
    # Everything is closed and committed. Interpreter teardown would only walk the frozen heap and make nanobind
    # print pages of "leaked" lines for triton's objects that torch keeps alive; the engine process skips it too.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
