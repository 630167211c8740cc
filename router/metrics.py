"""The router stream processor's Prometheus metrics, served with ``/healthz`` and ``/readyz`` on
``SLUICEGATE_ROUTER_METRICS_PORT`` (default 8003) by :class:`sluicegate.metrics_http.MetricsServer`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_BATCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class RouterMetrics:
    """What the router counts: records routed per model and tier, versions chosen for routed names, dead letters
    by reason, batch latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "sluicegate_router_routed",
            "Records from llm.inbound routed to a request topic, by model, tier and routing reason.",
            ["model", "tier", "reason"],
            registry=self.registry,
        )
        self.route_versions = Counter(
            "sluicegate_router_route_versions",
            "Records naming a routed public model, by route, the version chosen, and why (split, fast_path).",
            ["route", "version", "reason"],
            registry=self.registry,
        )
        self.dead_letters = Counter(
            "sluicegate_dead_letters",
            "Records sent to llm.dlq, by process and reason.",
            ["service", "reason"],
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "sluicegate_router_batch_seconds",
            "Time to route a fetched batch until every record is acknowledged and the offsets committed.",
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.batch_failures = Counter(
            "sluicegate_router_batch_failures",
            "Batches retried because Kafka failed while routing them.",
            registry=self.registry,
        )
