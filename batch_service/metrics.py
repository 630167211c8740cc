"""The batch worker's Prometheus metrics, served on ``SLUICEGATE_BATCH_METRICS_PORT`` (default 8004; 0: off).

The other processes answer scrapes on their event loop (``sluicegate.metrics_http``); a Celery solo worker's
loop runs only while a task runs, so this process serves its registry from prometheus_client's own HTTP
thread instead. Each process counts what it did; Prometheus sums across batch workers.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# |predicted - actual| / actual remaining time, from 0 (exact) up.
_ETA_ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)
#: Share of a batch's lines resolved when its ETA is checked against the real finish (the 10 % the ETA is held to).
ETA_CHECK_AT = 0.10


class BatchMetrics:
    """What the batch worker counts: lines enqueued and finished, lines in flight, the collector's lag behind
    ``llm.results``, active batches, and how far each batch's ETA was from its real finish."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lines_enqueued = Counter(
            "sluicegate_batch_lines_enqueued",
            "Batch lines published to the batch tier.",
            registry=self.registry,
        )
        self.lines_finished = Counter(
            "sluicegate_batch_lines_finished",
            "Batch lines given an outcome, by outcome (completed: a result; failed: an error, expiry or cancel).",
            ["outcome"],
            registry=self.registry,
        )
        self.lines_in_flight = Gauge(
            "sluicegate_batch_lines_in_flight",
            "Published batch lines without an outcome yet, over every active batch (at the last tick).",
            registry=self.registry,
        )
        self.active_batches = Gauge(
            "sluicegate_batch_active", "Batches not yet in a final state (at the last tick).", registry=self.registry
        )
        self.collector_lag = Gauge(
            "sluicegate_batch_collector_lag_records",
            "Records of llm.results past the collector's stored positions (after its last pass).",
            registry=self.registry,
        )
        self.eta_error = Histogram(
            "sluicegate_batch_eta_error_ratio",
            "Per finished batch: |ETA predicted when 10% of its lines were done - the real time left then| / "
            "the real time left then.",
            buckets=_ETA_ERROR_BUCKETS,
            registry=self.registry,
        )

    def count_finished(self, completed: int, failed: int) -> None:
        if completed:
            self.lines_finished.labels("completed").inc(completed)
        if failed:
            self.lines_finished.labels("failed").inc(failed)

    def serve(self, port: int) -> Any:
        """Serve ``/metrics`` on ``port`` from a daemon thread; returns the server (None when off or taken)."""
        if not port:
            return None
        try:
            server, _thread = start_http_server(port, registry=self.registry)
        except OSError as exc:
            log.warning("batch.metrics_port_unavailable port=%d error=%s", port, exc)
            return None
        log.info("batch.metrics_listening port=%d", port)
        return server


def eta_error(checked_at: float, predicted_finish: float, finished_at: float) -> float | None:
    """Relative error of an ETA made at ``checked_at`` that predicted ``predicted_finish``, given the real
    ``finished_at`` (all epoch seconds); None when the batch finished at the very moment it was checked."""
    actual_left = finished_at - checked_at
    if actual_left <= 0:
        return None
    return abs(predicted_finish - finished_at) / actual_left
