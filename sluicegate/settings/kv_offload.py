"""A worker's KV offload tiers: how much host memory and local disk its engine's prefix cache may spill into, and
the shared store every worker of the model reads (a Redis of its own, not the streams' Redis)."""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import SettingsBase


class KVOffloadSettings(SettingsBase):
    """The tiers under a worker's KV pool; every one is off at its default."""

    kv_host_tier_gb: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Host memory (GiB) for KV blocks that fill in the engine's pool, least recently used dropped "
        "first; 0 is off. On a CPU worker this is the same RAM as the pool itself.",
    )
    kv_disk_tier_dir: str = Field(
        "",
        description="Folder of the local-disk KV tier (one file per block, per model configuration); a restarted "
        "worker serves and re-publishes what it holds. Empty: no disk tier.",
    )
    kv_disk_tier_gb: float = Field(
        4.0, gt=0, allow_inf_nan=False, description="Most the disk KV tier keeps (GiB), least recently used removed."
    )
    kv_shared_tier_url: str = Field(
        "",
        description="redis:// URL of the shared KV tier that every worker of a model reads (a request resumed after "
        "its worker died loads its prompt's blocks from it). Give it a Redis of its own with maxmemory and "
        "maxmemory-policy allkeys-lru, not the streams' Redis. Empty: no shared tier.",
    )

    @field_validator("kv_shared_tier_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("kv_shared_tier_url must be a redis://, rediss:// or unix:// URL, or empty")
        return value
