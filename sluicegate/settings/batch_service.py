"""The batch workers (Celery): the settings of a batch-worker process, composed of routing (lines go where ingress
would send them), the Files and Batches API's ground and the quotas, plus its own pacing, locks and metrics port."""

from __future__ import annotations

from pydantic import Field

from .backbone import BackboneSettings
from .batch_api import BatchApiSettings
from .fleet import FleetSettings
from .routing import RoutingSettings
from .telemetry import TelemetrySettings
from .usage import TenantQuotaSettings


class BatchServiceSettings(
    RoutingSettings, BatchApiSettings, BackboneSettings, TelemetrySettings, FleetSettings, TenantQuotaSettings
):
    """What a batch worker reads: no ingress-only, engine, worker or router-process fields."""

    batch_chunk_size: int = Field(200, ge=1, description="Batch lines published to Kafka per acknowledged chunk.")
    batch_max_in_flight: int = Field(
        2000,
        ge=1,
        description="Lines of one batch published and not yet finished before it waits: Kafka holds the backlog "
        "either way, this bounds what a cancel must take back.",
    )
    batch_worker_cpu_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness of a batch worker's process (validate, enqueue, collect): on cores shared with "
        "interactive serving it runs when they idle; 0 keeps normal priority.",
    )
    batch_tick_s: float = Field(1.0, gt=0, description="Seconds between the batch beat's ticks (advance, collect).")
    batch_lock_ttl_s: float = Field(
        30.0, gt=0, description="Lifetime of a batch's (and the collector's) lock, so a dead holder frees it."
    )
    batch_cancel_grace_s: float = Field(
        5.0, ge=0, description="Seconds a cancelled batch waits for its in-flight lines' aborts before finishing."
    )
    batch_stall_check_s: float = Field(
        10.0,
        gt=0,
        description="Seconds without a new result after which a batch reads its outstanding lines' status records "
        "(lines that failed at the worker publish no result).",
    )
    batch_metrics_port: int = Field(
        8004, ge=0, le=65535, description="Port of a batch worker's /metrics (Celery worker); 0 disables it."
    )
