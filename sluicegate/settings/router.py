"""The router stream processor: the settings of its process, composed of routing, the usage rollup it runs and
the quotas it checks, plus its own consumer group and metrics port."""

from __future__ import annotations

from pydantic import Field

from .backbone import BackboneSettings
from .fleet import FleetSettings
from .routing import RoutingSettings
from .telemetry import TelemetrySettings
from .usage import TenantQuotaSettings, UsageRollupSettings


class RouterSettings(
    RoutingSettings, UsageRollupSettings, BackboneSettings, TelemetrySettings, FleetSettings, TenantQuotaSettings
):
    """What the router process reads: no ingress, engine, worker or batch fields."""

    router_group: str = Field("sluicegate-router", description="Consumer group of the router stream processor.")
    router_metrics_port: int = Field(
        8003, ge=0, le=65535, description="Port of the router stream processor's /metrics and /healthz; 0 disables."
    )
