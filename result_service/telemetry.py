"""The result service's metrics (``GET /metrics``) and its relay span.

Metrics: connections and resumes by ``last_id`` per transport, connections open now, multiplexed sockets open now,
clients dropped as too slow, and the hub's fan-out (streams followed, subscribers reading them) read at scrape time.
While tracing is on, each relayed connection gets a span in the request's own trace, whose context the request's
status record carries (a browser's WebSocket sends no ``traceparent``). The stream routes get no HTTP server span
(``sluicegate.telemetry.EXCLUDED_URLS``: it was a one-span trace of its own per connection); were one current, the
relay span would link to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from schemas import TraceContext
from sluicegate.stream_subscription import START_SEQ
from sluicegate.telemetry import context_from_traceparent, tracing_enabled

from .access import StreamGrant
from .hub import StreamHub


class _FanOut(Collector):
    def __init__(self) -> None:
        self.hub: StreamHub | None = None

    def collect(self) -> Iterator[Any]:
        if self.hub is None:
            return
        streams = GaugeMetricFamily("sluicegate_relay_streams", "Redis streams the relay follows now.")
        streams.add_metric([], float(self.hub.stream_count))
        subscribers = GaugeMetricFamily(
            "sluicegate_relay_subscribers", "Client subscriptions reading them now (fan-out = subscribers / streams)."
        )
        subscribers.add_metric([], float(self.hub.subscriber_count))
        yield streams
        yield subscribers


class RelayMetrics:
    """One registry per app, like ingress's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.connections = Counter(
            "sluicegate_relay_connections",
            "Relayed connections (streams on a multiplexed socket), by transport.",
            ["transport"],
            registry=r,
        )
        self.resumes = Counter(
            "sluicegate_relay_resumes",
            "Connections resuming after an entry id (last_id / Last-Event-ID), by transport.",
            ["transport"],
            registry=r,
        )
        self.open = Gauge("sluicegate_relay_open_connections", "Connections relaying now.", ["transport"], registry=r)
        self.mux_sockets = Gauge(
            "sluicegate_relay_mux_sockets",
            "Multiplexed stream sockets (/v1/streams) open now; their streams count as websocket-mux connections.",
            registry=r,
        )
        self.slow_consumers = Counter(
            "sluicegate_relay_slow_consumers", "Clients dropped for falling too far behind.", ["transport"], registry=r
        )
        self._fan_out = _FanOut()
        r.register(self._fan_out)
        self.tracer = trace.get_tracer("sluicegate.result_service")

    def watch_hub(self, hub: StreamHub) -> None:
        self._fan_out.hub = hub

    @contextmanager
    def relaying(self, transport: str, grant: StreamGrant, trace_context: TraceContext | None) -> Iterator[None]:
        """Count one relayed connection for its lifetime, under a span while tracing is on."""
        self.connections.labels(transport).inc()
        if grant.after_seq > START_SEQ:
            self.resumes.labels(transport).inc()
        gauge = self.open.labels(transport)
        gauge.inc()
        span = None
        if tracing_enabled():
            server = trace.get_current_span().get_span_context()
            parent = context_from_traceparent(*_trace_fields(trace_context)) if trace_context else None
            span = self.tracer.start_span(
                f"relay {transport}",
                context=parent,
                kind=trace.SpanKind.INTERNAL,
                links=[Link(server)] if parent is not None and server.is_valid else None,
                attributes={
                    "sluicegate.request_id": grant.request_id,
                    "sluicegate.relay.transport": transport,
                    "sluicegate.relay.after_seq": grant.after_seq,
                },
            )
        try:
            yield
        finally:
            gauge.dec()
            if span is not None:
                span.end()


def _trace_fields(context: TraceContext) -> tuple[str, str | None]:
    return context.traceparent, context.tracestate
