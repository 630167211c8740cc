"""The Celery tasks of the batch workers: ``tick`` (run by the beat every ``batch_tick_s``: collect results, step
every active batch, refresh the ETAs) and ``advance`` (step one batch now; sent when a batch is created or
cancelled). Both are idempotent and lock what they touch, so duplicates and re-deliveries are harmless.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery
from celery.signals import worker_process_shutdown, worker_shutdown

from sluicegate.batches.celery_app import ADVANCE_TASK, TICK_TASK, make_app
from sluicegate.settings import BatchServiceSettings
from sluicegate.telemetry import configure_tracing, instrument_celery

from .collector import Collector
from .eta import update_etas
from .lifecycle import advance
from .metrics import BatchMetrics
from .runtime import BatchRuntime, Runner

log = logging.getLogger(__name__)


async def tick(runtime: BatchRuntime) -> int:
    """One beat: collect, then step each active batch (oldest first), then the ETAs. Returns the active count."""
    if runtime.collector is None:
        runtime.collector = Collector(runtime)
    try:
        await runtime.collector.collect()
    except Exception:
        # Results stay in Kafka; the next tick reads them. Stepping batches must go on (cancels, expiry).
        log.exception("batch.collect_failed")
    active = await runtime.batches.active()
    for batch_id in active:
        try:
            await advance(runtime, batch_id)
        except Exception:
            log.exception("batch.step_failed batch_id=%s", batch_id)
    await update_etas(runtime, await runtime.batches.active())
    return len(active)


async def advance_one(runtime: BatchRuntime, batch_id: str) -> str | None:
    """Step one batch (after collecting, so a batch that just got its last result can finish)."""
    if runtime.collector is None:
        runtime.collector = Collector(runtime)
    await runtime.collector.collect()
    return await advance(runtime, batch_id)


def register(app: Celery, settings: BatchServiceSettings, metrics: BatchMetrics | None = None) -> Runner:
    """Register the tasks on ``app``; they run on one :class:`Runner` per process."""
    runner = Runner(settings, metrics)

    @app.task(name=TICK_TASK, acks_late=True, reject_on_worker_lost=True)
    def tick_task() -> int:
        return int(runner.run(tick))

    @app.task(name=ADVANCE_TASK, acks_late=True, reject_on_worker_lost=True)
    def advance_task(batch_id: str) -> Any:
        return runner.run(advance_one, batch_id)

    def _shutdown(**_: Any) -> None:
        try:
            runner.close()
        except Exception:
            log.exception("batch.runner_close_failed")

    worker_process_shutdown.connect(_shutdown, weak=False)
    worker_shutdown.connect(_shutdown, weak=False)
    return runner


def build_worker_app(settings: BatchServiceSettings | None = None, metrics: BatchMetrics | None = None) -> Celery:
    """The Celery app with its tasks, for ``sluicegate batch-worker`` (settings read from the environment unless
    given: a batch worker's own, :class:`BatchServiceSettings`)."""
    settings = settings or BatchServiceSettings()
    app = make_app(settings)
    register(app, settings, metrics)
    return app


def run_worker(settings: BatchServiceSettings, *, beat: bool = True, loglevel: str = "INFO") -> None:
    """Run a batch worker in this process (solo pool: one process, one event loop, nothing to orphan on kill -9),
    with the beat embedded unless ``beat`` is False."""
    if settings.batch_worker_cpu_nice:
        # Batch work is never urgent: on cores it shares with interactive serving it takes what they leave.
        os.nice(settings.batch_worker_cpu_nice)
    # Solo pool: the tasks run in this process, so its tracing is set up here (a prefork pool would need it in
    # each child, from ``worker_process_init``). Off without an OTLP endpoint.
    configure_tracing("sluicegate-batch-worker", settings.otlp_endpoint)
    instrument_celery()
    metrics = BatchMetrics()
    metrics.serve(settings.batch_metrics_port)
    app = build_worker_app(settings, metrics)
    if loglevel.upper() != "DEBUG":
        # Celery's own line per task received, succeeded, expired and sent by the beat: a tick every
        # ``batch_tick_s`` made them nearly the whole log (4,158 of 4,234 lines in 23 minutes). The batches' own
        # lines say what happened; Celery's warnings and errors still show.
        for noisy in ("celery.worker.strategy", "celery.worker.request", "celery.app.trace", "celery.beat"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = ["worker", "--pool=solo", f"--loglevel={loglevel}", "--without-gossip", "--without-mingle"]
    # Scale by running more batch workers (``--no-beat``); one beat is enough, a second only duplicates ticks.
    argv += ["-Q", app.conf.task_default_queue, "-n", f"batch-{settings.topic_prefix or 'default'}-{os.getpid()}@%h"]
    if beat:
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        argv.append("--beat")
    app.worker_main(argv)
