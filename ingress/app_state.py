"""What ``create_app`` keeps on ``app.state`` for the routes, and typed access to it from a request: the
service (made in the lifespan), the tracer and the metrics (made with the app)."""

from __future__ import annotations

from fastapi import Request
from opentelemetry.trace import Tracer

from .service import IngressService
from .telemetry import IngressMetrics


def service_of(request: Request) -> IngressService:
    """The app's :class:`IngressService`: Kafka, Redis and the router behind every endpoint."""
    service: IngressService = request.app.state.service
    return service


def tracer_of(request: Request) -> Tracer:
    """The tracer for the span each accepted request gets."""
    tracer: Tracer = request.app.state.tracer
    return tracer


def metrics_of(request: Request) -> IngressMetrics:
    """The app's Prometheus metrics."""
    metrics: IngressMetrics = request.app.state.metrics
    return metrics
