"""What the GPU workers and the services in front of them (ingress, the router, the batch workers) must agree on:
one side acts on each value and the other side counts on it, so a deployment gives both the same."""

from __future__ import annotations

from pydantic import Field

from .base import SettingsBase


class FleetSettings(SettingsBase):
    """Heartbeat cadence, LoRA registry snapshots, ingress reader leases, KV events and the default queue budget."""

    # Workers beat every interval; whoever routes counts a worker live for three of them.
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between worker heartbeats.")
    # Ingress and the router reuse a registry snapshot this long, and a worker its adapter lookups: an unload is
    # seen everywhere within it.
    lora_cache_ttl_s: float = Field(
        2.0,
        ge=0,
        description="Seconds ingress and the router reuse their snapshot of the LoRA adapter registry (another "
        "process's load or unload is seen within it; the process's own at once).",
    )
    # Ingress renews its lease; workers stop the requests of an ingress whose lease is gone.
    reader_lease_s: float = Field(
        15.0,
        ge=0,
        description="TTL of each ingress instance's reader lease in Redis, renewed every third of it. Workers stop "
        "an OpenAI-style request (its client cannot resume) once its ingress's lease is found missing at every check "
        "(a third of it apart) over half of it, and never start that ingress's requests still queued: an ingress "
        "that died mid-response leaves no generation running for nobody. Give ingress and workers the same value. "
        "0: no leases.",
    )
    # Workers publish what their prefix caches hold; ingress and the router route prompts on it.
    kv_events: bool = Field(
        True,
        description="Workers publish their KV-cache events (blocks cached and evicted, by block hash) on "
        "llm.kv_events, and ingress and the router send a prompt to the worker holding its longest cached prefix "
        "against load (docs/routing.md); false: neither, the prompt-prefix key alone decides.",
    )
    # Ingress gives a request without a deadline this budget; workers export it, so an alert compares backlogs with it.
    default_queue_budget_s: float = Field(
        0.0,
        ge=0,
        le=365 * 86400,
        description="Default queue-time budget: a request without a deadline gets now + this; 0 means no deadline.",
    )
