"""The KV offload tiers' numbers, read from ``engine.stats().kv_offload`` when Prometheus scrapes: blocks served and
bytes moved per tier, the time lookups spent loading, and the blocks refused as damaged or never written down."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpu_workers.engine import EngineFront


class KVTierCollector(Collector):
    """Cumulative counters of the engine's offload tiers (nothing when the engine has none)."""

    def __init__(self, engine: EngineFront, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[Any]:
        try:
            stats = self.engine.stats().kv_offload
        except Exception:  # an engine not started (or gone) has no stats; the scrape still answers
            return
        if stats is None:
            return
        for name, doc, per_tier in (
            ("sluicegate:kv_tier_hit_blocks", "KV blocks a prefix lookup loaded from an offload tier.", stats.hits),
            ("sluicegate:kv_tier_loaded_bytes", "Bytes of KV blocks loaded from an offload tier.", stats.bytes_loaded),
            ("sluicegate:kv_tier_written_bytes", "Bytes of KV blocks written to an offload tier.", stats.bytes_written),
        ):
            family = CounterMetricFamily(name, doc, labels=["model", "tier"])
            for tier, value in per_tier.items():
                family.add_metric([self.model, tier], float(value))
            yield family
        for name, doc, value in (
            ("load_seconds", "Time prefix lookups spent loading blocks from the tiers.", stats.load_seconds),
            ("loads", "Prefix lookups that loaded blocks from the tiers.", stats.loads),
            ("damaged_blocks", "Stored blocks refused (damaged, truncated, misnamed) and recomputed.", stats.damaged),
            ("dropped_blocks", "Filled blocks not written down: the writer's queue was full.", stats.dropped),
            ("write_errors", "Writes to a tier that failed (a store down, a disk full).", stats.write_errors),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"sluicegate:kv_tier_{name}", doc, labels=["model"])
            counter.add_metric([self.model], float(value))
            yield counter
