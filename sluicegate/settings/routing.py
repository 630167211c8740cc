"""Routing a request to a model's topic and partition: the models accepted, the routing file, and the router's
policies. Ingress and the batch workers route in-process as the router stream processor does, so all three read
these; the router library builds on the backbone (topics named by the prefix, partitions per topic)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from .backbone import BackboneSettings
from .base import comma_separated


class RoutingSettings(BackboneSettings):
    """Served models, the routing file, and the prefix-affinity and load policies."""

    served_models: str = Field(
        "",
        description="Comma-separated models ingress and the router accept even with no live worker (queued in "
        "Kafka); `up` adds the models it serves; the compose file names its demo model.",
    )
    routes_file: Path | None = Field(
        None,
        description="Routing file (YAML): public model names -> weighted, sticky versions, canaries with rollback, "
        "a fast path for short prompts; reloaded on change. `sluicegate routes check FILE` validates one.",
    )
    routes_reload_s: float = Field(
        1.0, gt=0, description="How often ingress, the router and batch workers check the routing file and rollbacks."
    )
    router_prefix_chars: int = Field(2048, ge=1, description="Prompt characters hashed for prefix affinity.")
    router_prefix_tokens: int = Field(64, ge=1, description="Prompt token ids hashed for prefix affinity.")
    router_max_waiting: int = Field(
        8, ge=1, description="Waiting sequences at which a worker counts as overloaded for routing."
    )
    router_min_free_kv: float = Field(
        0.05, ge=0.0, le=1.0, description="Free KV-block fraction below which a worker counts as overloaded."
    )
    router_kv_tokens_per_request: float = Field(
        256.0,
        ge=0.0,
        description="Routing on the cached prefix: a request a worker runs or queues weighs as this many prompt "
        "tokens to prefill, against the tokens of the prompt another worker holds cached (docs/routing.md).",
    )
    router_kv_tokens_per_backlog_s: float = Field(
        1024.0,
        ge=0.0,
        description="Routing on the cached prefix: a second of a worker's backlog at the request's tier weighs as "
        "this many prompt tokens to prefill.",
    )
    router_kv_max_lag_s: float = Field(
        6.0,
        gt=0.0,
        description="A worker whose heartbeat, older than this, reports KV events the router has not read makes "
        "the router fall back to the prompt-prefix key for its model (counted as stale_events).",
    )
    router_kv_index_max_blocks: int = Field(
        262_144,
        ge=1,
        description="Block hashes the cached-prefix index keeps per worker at most (about 70 bytes each; the "
        "oldest go first).",
    )
    router_tenant_half_life_s: float = Field(
        30.0,
        ge=0.0,
        description="Half-life of the tokens per tenant and worker the router counts: when a worker is overloaded "
        "only tenants above an equal share of its recent tokens are diverted, the others keep their affinity; "
        "0 diverts every request as before.",
    )

    @property
    def served_model_names(self) -> frozenset[str]:
        """``served_models`` as names (blanks and spaces around the commas dropped)."""
        return frozenset(comma_separated(self.served_models))
