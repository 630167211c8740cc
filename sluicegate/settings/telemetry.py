"""Telemetry: logs, traces and the switch for per-request metrics, alike for every process. Each service's own
``/metrics`` port is its own setting, beside its other fields."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import SettingsBase


class TelemetrySettings(SettingsBase):
    """How a process logs and traces, and whether it counts per-request metrics."""

    log_level: str = Field("INFO", description="Log level for every service.")
    log_format: Literal["json", "kv"] = Field("kv", description="Structured log line format.")
    otlp_endpoint: str = Field(
        "",
        description="OTLP/HTTP endpoint for traces, an alias of OTEL_EXPORTER_OTLP_ENDPOINT (which wins); with "
        "neither (nor OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set, tracing is off.",
    )
    metrics_enabled: bool = Field(
        True,
        description="False: no per-request metrics work (ingress's request middleware, the worker's metrics and "
        "engine hooks; /metrics still answers, emptier). A switch for measuring what the metrics cost; the worker "
        "keeps its telemetry while tracing is on (its request span lives there).",
    )
