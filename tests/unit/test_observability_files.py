"""The shipped dashboard and alert rules parse, and every metric they name is one a Sluicegate process
registers (read from the real registries of ingress, router, result service and worker)."""

from __future__ import annotations

import json

import yaml
from prometheus_client import generate_latest

from gpu_workers.engine.outputs import EngineStats
from gpu_workers.worker.telemetry import WorkerTelemetry
from ingress.telemetry import IngressMetrics
from result_service.telemetry import RelayMetrics
from router.metrics import RouterMetrics
from tests.e2e.observability_names import (
    ALERTS,
    DASHBOARD,
    dashboard_expressions,
    exposed_names,
    referenced_metrics,
    rule_expressions,
)


class _EngineStandIn:
    """Only what WorkerTelemetry reads of an engine: its stats and the delta hook."""

    def add_delta_observer(self, observer: object) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats(1, 2, 30, 40, 0.5, 10, 5, 0)


class _HubStandIn:
    stream_count = 1
    subscriber_count = 2


def registered_names() -> set[str]:
    relay = RelayMetrics()
    relay.watch_hub(_HubStandIn())  # type: ignore[arg-type]
    registries = [
        IngressMetrics().registry,
        RouterMetrics().registry,
        relay.registry,
        WorkerTelemetry(_EngineStandIn(), "m", "w").registry,  # type: ignore[arg-type]
    ]
    return set().union(*(exposed_names(generate_latest(r).decode()) for r in registries))


def test_files_parse_and_hold_what_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and all(panel["targets"] for panel in dashboard["panels"])
    alerts = {rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    assert {
        "SluicegateTimeToFirstTokenP99High",
        "SluicegateBacklogOverQueueBudget",
        "SluicegateDeadLetters",
        "SluicegateNoWorkerHeartbeats",
    } <= alerts


def test_every_metric_the_dashboard_and_rules_name_is_registered() -> None:
    referenced = referenced_metrics(dashboard_expressions() + rule_expressions())
    assert len(referenced) > 20  # the extraction itself works
    assert referenced - registered_names() == set()


def test_a_misspelt_metric_is_caught() -> None:
    assert referenced_metrics(['rate(sluicegate:time_to_first_token_second_bucket{tier="x"}[5m])']) - (
        registered_names()
    ) == {"sluicegate:time_to_first_token_second_bucket"}


def test_the_charts_autoscaling_query_reads_a_registered_metric() -> None:
    """KEDA's prometheus trigger scales worker pools on the backlog gauge the worker exports under this name."""
    values = yaml.safe_load((DASHBOARD.parents[1] / "helm" / "sluicegate" / "values.yaml").read_text())
    metric = values["keda"]["backlogMetric"]
    assert referenced_metrics([f'max({metric}{{model="m"}})']) == {metric}
    assert metric in registered_names()
