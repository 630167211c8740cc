"""The batch worker's metrics: the ETA's error measure, and the registry served over HTTP from its own thread."""

from __future__ import annotations

import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families

from batch_service.metrics import BatchMetrics, eta_error


def test_eta_error_is_relative_to_the_real_time_left() -> None:
    # Checked at t=100 predicting t=150; it finished at t=200: 50 s off over 100 s really left.
    assert eta_error(100.0, 150.0, 200.0) == 0.5
    assert eta_error(100.0, 200.0, 200.0) == 0.0
    assert eta_error(100.0, 260.0, 200.0) == 0.6
    assert eta_error(100.0, 150.0, 100.0) is None  # finished as it was checked: nothing to score


def test_metrics_are_served_and_count_finished_lines_by_outcome() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = BatchMetrics()
    server = metrics.serve(port)
    assert server is not None
    try:
        metrics.lines_enqueued.inc(3)
        metrics.count_finished(completed=2, failed=1)
        metrics.eta_error.observe(0.2)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("sluicegate_batch_lines_enqueued_total", ())] == 3
    assert samples[("sluicegate_batch_lines_finished_total", (("outcome", "completed"),))] == 2
    assert samples[("sluicegate_batch_lines_finished_total", (("outcome", "failed"),))] == 1
    assert samples[("sluicegate_batch_eta_error_ratio_count", ())] == 1
    assert metrics.serve(0) is None  # 0: off
