"""The engine's numbers under vLLM's names (``sluicegate:*``): gauges and cumulative counters read from
``engine.stats()`` each time Prometheus scrapes, so the engine itself imports nothing of the worker's metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpu_workers.engine import EngineFront
from schemas import TIERS

_MT = ["model", "tier"]


class EngineCollector(Collector):
    """The engine's gauges and cumulative counters, read from ``engine.stats()`` when Prometheus scrapes."""

    def __init__(self, engine: EngineFront, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[Any]:
        try:
            stats = self.engine.stats()
        except Exception:  # an engine not started (or gone) has no stats; the scrape still answers
            return
        labels = [self.model]
        for name, doc, by_priority in (
            ("sluicegate:num_requests_running", "Requests in the engine's running batch.", stats.running_by_priority),
            ("sluicegate:num_requests_waiting", "Requests waiting in the engine's queue.", stats.waiting_by_priority),
        ):
            family = GaugeMetricFamily(name, doc, labels=_MT)
            for rank, tier in enumerate(TIERS):  # the engine's priority is the tier's rank (schemas.tier_rank)
                family.add_metric([self.model, tier], float(by_priority.get(rank, 0)))
            yield family
        for name, doc, value in (
            ("sluicegate:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", stats.kv_cache_usage),
            (
                "sluicegate:spec_decode_acceptance_rate",
                "Share of speculative draft tokens the target accepted (0 to 1; 0 when not speculating).",
                stats.spec_acceptance_rate,
            ),
            (
                "sluicegate:spec_decode_mean_accepted_length",
                "Tokens emitted per speculative verification step (accepted drafts + 1; 0 when not speculating).",
                stats.spec_mean_accepted_length,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric(labels, float(value))
            yield family
        for name, doc, total in (
            (
                "sluicegate:prefix_cache_queries",
                "Prompt tokens looked up.",
                stats.prefix_cache_queries,
            ),
            ("sluicegate:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("sluicegate:num_preemptions", "Sequences the scheduler preempted.", stats.num_preemptions),
            ("sluicegate:spec_decode_num_drafts", "Speculative verification steps.", stats.spec_num_drafts),
            ("sluicegate:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_num_draft_tokens),
            (
                "sluicegate:spec_decode_num_accepted_tokens",
                "Draft tokens the target accepted.",
                stats.spec_num_accepted_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model"])
            counter.add_metric(labels, float(total))
            yield counter
