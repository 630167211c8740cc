"""Token usage: the per-tenant quotas every admitting service checks (ingress, the router, the batch workers), and
the rollup that turns the ``llm.usage`` topic into per-tenant aggregates in Redis (the router runs it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .backbone import BackboneSettings
from .base import SettingsBase


class TenantQuotaSettings(SettingsBase):
    """Default and per-tenant token quotas (a key's own quotas are admission limits of ingress)."""

    tenant_tokens_per_day: int = Field(0, ge=0, description="Default token quota per tenant per UTC day; 0: none.")
    tenant_tokens_per_month: int = Field(0, ge=0, description="Default token quota per tenant per UTC month; 0: none.")
    tenant_quotas: dict[str, dict[Literal["tokens_per_day", "tokens_per_month"], int]] = Field(
        {},
        description='Per-tenant token quotas over the tenant_tokens_* defaults, as JSON (e.g. {"acme": '
        '{"tokens_per_day": 100000, "tokens_per_month": 2000000}}; 0 means none).',
    )


class UsageRollupSettings(BackboneSettings):
    """The usage rollup: a consumer of the usage topic that writes aggregates to Redis."""

    usage_rollup: bool = Field(
        True, description="Run the usage rollup (llm.usage -> per-tenant aggregates in Redis) in the router process."
    )
    usage_group: str = Field("sluicegate-usage", description="Consumer group of the usage rollup.")
    usage_dedup_ttl_s: int = Field(
        7 * 86400, ge=60, description="Seconds the rollup remembers a counted request id (duplicates are skipped)."
    )
    usage_retention_days: int = Field(400, ge=1, description="Days the hourly per-tenant usage aggregates are kept.")
