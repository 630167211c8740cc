"""The worker exports the engine's speculative-decoding counters and the two derived gauges (vLLM-like names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gpu_workers.engine import EngineStats
from gpu_workers.worker.engine_collector import EngineCollector


class _StatsOnly:
    """An engine front reduced to what the collector reads: ``stats()``."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def test_spec_decode_metrics_follow_engine_stats() -> None:
    stats = EngineStats(
        num_running=1, num_waiting=0, num_free_blocks=10, num_total_blocks=10, prefix_cache_hit_rate=0.0,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
        spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=30,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(EngineCollector(_StatsOnly(stats), "m"))  # type: ignore[arg-type]

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"model": "m"})

    assert value("sluicegate:spec_decode_acceptance_rate") == 0.75
    assert value("sluicegate:spec_decode_mean_accepted_length") == 4.0
    assert value("sluicegate:spec_decode_num_drafts_total") == 10
    assert value("sluicegate:spec_decode_num_draft_tokens_total") == 40
    assert value("sluicegate:spec_decode_num_accepted_tokens_total") == 30
