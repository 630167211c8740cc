"""Ingress metrics: Prometheus metrics in a per-app registry, plus the ASGI middleware that counts and times
requests. Tracing is the process-wide bootstrap of :mod:`sluicegate.telemetry`.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class IngressMetrics:
    """The ingress's Prometheus metrics; one registry per app so several apps can live in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sluicegate_ingress_requests_total",
            "HTTP requests by route and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sluicegate_ingress_request_seconds",
            "Time from request start to the end of the response body (streams included).",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.published = Counter(
            "sluicegate_ingress_published_total",
            "Requests published to Kafka, by model, tier and routing reason.",
            ["model", "tier", "reason"],
            registry=self.registry,
        )
        self.publish_failures = Counter(
            "sluicegate_ingress_publish_failures_total",
            "Requests that could not be published (answered 503).",
            ["model"],
            registry=self.registry,
        )
        self.publish_latency = Histogram(
            "sluicegate_ingress_publish_seconds",
            "Time to get a publish acknowledged by every in-sync replica.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "sluicegate_ingress_time_to_first_token_seconds",
            "From accepting an OpenAI-style request to relaying its first text.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            "sluicegate_ingress_rejected_total",
            "Requests turned away before publishing, by cause (rate_limited, backlog_full).",
            ["reason"],
            registry=self.registry,
        )
        self.backlog = Gauge(
            "sluicegate_ingress_backlog_requests",
            "Unfinished requests per model at the last backlog read (worker group lag on its request topics), read "
            "as requests are admitted: it holds its last value while none arrive (alert on the workers' "
            "sluicegate_worker_backlog_seconds instead).",
            ["model"],
            registry=self.registry,
        )
        self.response_cache = Counter(
            "sluicegate_ingress_response_cache_total",
            "Response-cache lookups of deterministic requests, by model version and outcome (hit, miss, bypass).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.response_cache_bytes = Counter(
            "sluicegate_ingress_response_cache_bytes_total",
            "Bytes of cached replies (their stream events, JSON) stored and served.",
            ["direction"],
            registry=self.registry,
        )
        self.routed = Counter(
            "sluicegate_ingress_routed_total",
            "Requests for a routed model name, by route, the version chosen and why (split, fast_path).",
            ["route", "version", "reason"],
            registry=self.registry,
        )
        self.route_weight = Gauge(
            "sluicegate_ingress_route_weight",
            "A version's live weight in its route (0 after a canary rollback).",
            ["route", "version"],
            registry=self.registry,
        )
        self.canary_rollbacks = Counter(
            "sluicegate_ingress_canary_rollbacks_total",
            "Canaries rolled back to weight 0, by route, version and cause (error_rate, ttft_p99).",
            ["route", "version", "cause"],
            registry=self.registry,
        )
        self.routes_reload_failures = Counter(
            "sluicegate_ingress_routes_reload_failures_total",
            "Changed routing files that failed validation (the previous routes stay in force).",
            registry=self.registry,
        )
        self.cancellations = Counter(
            "sluicegate_ingress_cancellations_total",
            "Cancellations ingress issued, by cause.",
            ["cause"],
            registry=self.registry,
        )


class MetricsMiddleware:
    """Counts requests and times them until the last body byte, labelled by route template."""

    def __init__(self, app: ASGIApp, metrics: IngressMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(template, method, str(status)).inc()
            self.metrics.latency.labels(template, method).observe(time.perf_counter() - start)
