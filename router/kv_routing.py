"""Routing on the exact cached prefix: the prompt's block hashes (``sluicegate.block_hashes``, over the token ids the
worker will see) against each worker's cached blocks (:class:`router.kv_index.KVIndex`), weighed against load.

A worker's cost for a request is the prompt tokens it would have to prefill (those past its cached prefix, a block in
an offload tier counted at its tier's weight: ``CachedPrefixPolicy.tier_weights``) plus
its load in the same unit: ``tokens_per_request`` for each request it runs or queues (from its heartbeat, plus
those this router sent it since that heartbeat) and ``tokens_per_backlog_s`` for each second of backlog at the
request's tier. The cheapest worker that is not overloaded (``LoadPolicy``) takes it, on one of its partitions
picked by the key (so a burst sharing a prefix lands on one partition). With no hashes (no tokenizer published),
or a live worker whose events are missing or stale, or every worker overloaded, it answers None and the
prompt-prefix key decides as before (:func:`router.policy.choose_partition`); why is counted in
``sluicegate_kv_routing``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from schemas import Tier, WorkerHeartbeat
from sluicegate.block_hashes import prompt_block_hashes

from .kv_index import KVIndex, short_hash
from .policy import LoadPolicy, PartitionChoice, keyed_partition, owned_partitions

#: The outcomes counted: routed on the cache, or why the key decided instead.
OUTCOMES = ("cached_prefix", "no_tokens", "no_events", "stale_events", "all_busy")


@dataclass(frozen=True)
class CachedPrefixPolicy:
    """How a cached prefix weighs against load (in prompt tokens a worker would have to prefill)."""

    tokens_per_request: float = 256.0
    tokens_per_backlog_s: float = 1024.0
    max_lag_s: float = 6.0
    max_blocks: int = 512  # leading blocks hashed and looked up at most (8k tokens at 16 a block)
    # What loading an adapter a worker does not hold costs it, in prompt tokens: a fetch and a weight upload, a
    # few hundred milliseconds, so a holder wins unless the other has far more of the prompt cached.
    tokens_per_adapter_load: float = 1024.0
    # What a cached block is worth by where it sits, against a pool hit's 1 (docs/routing.md): a load from host
    # memory costs a copy, from disk a read, from the shared store a round trip, and the store may have evicted it
    # without telling (its events say what was written, not what is left).
    tier_weights: Mapping[str, float] = field(
        default_factory=lambda: {"pool": 1.0, "host": 0.9, "disk": 0.75, "shared": 0.5}
    )


@dataclass
class KVRouting:
    """What a routing process keeps for cached-prefix routing: the index, what it sent each worker lately, and
    the counters."""

    index: KVIndex
    policy: CachedPrefixPolicy = field(default_factory=CachedPrefixPolicy)
    registry: CollectorRegistry | None = None
    # worker -> monotonic times of the requests sent to it since its last heartbeat (the load it does not show yet)
    _sent: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.outcomes = Counter(
            "sluicegate_kv_routing",
            "Routing decisions on the exact cached prefix, by model and outcome: cached_prefix (the index chose), or "
            "why the prompt-prefix key decided instead (no_tokens, no_events, stale_events, all_busy).",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.index_blocks = Gauge(
            "sluicegate_kv_index_blocks", "Block hashes the cached-prefix index holds.", registry=self.registry
        )
        self.index_blocks.set_function(lambda: self.index.num_blocks)
        self.index_bytes = Gauge(
            "sluicegate_kv_index_bytes", "Memory the cached-prefix index's hash sets take.", registry=self.registry
        )
        self.index_bytes.set_function(self.index.memory_bytes)

    def prompt_hashes(self, model: str, token_ids: Sequence[int], lora_int_id: int = 0) -> list[int] | None:
        """The prompt's leading block hashes as the index keys them; None when no worker's block size is known."""
        block_size = self.index.block_size(model)
        if block_size is None:
            return None
        hashes = prompt_block_hashes(token_ids, block_size, lora_int_id, self.policy.max_blocks)
        return [short_hash(h) for h in hashes]

    def choose(
        self,
        model: str,
        topic: str,
        key: bytes,
        partitions: int,
        tier: Tier,
        heartbeats: Sequence[WorkerHeartbeat],
        load: LoadPolicy,
        hashes: list[int] | None,
        adapter: str | None = None,
    ) -> tuple[PartitionChoice | None, int]:
        """The partition of the worker with the cheapest cost, and the prompt tokens it holds cached; (None, 0)
        when the key should decide (counted by why). For an ``adapter`` (``hashes`` seeded by its id), only the
        workers that serve adapters count, and one that does not hold it pays ``tokens_per_adapter_load``."""
        owners = [b for b in heartbeats if owned_partitions(b, topic, partitions)]
        if adapter is not None:
            owners = [b for b in owners if b.serves_adapters]
        refusal = self._refusal(model, owners, load, hashes)
        self.outcomes.labels(model, refusal or "cached_prefix").inc()
        if refusal is not None or hashes is None:
            return None, 0
        self.index.forget_others(model, (b.worker_id for b in heartbeats))
        block_size = self.index.block_size(model) or 1
        prompt_tokens = len(hashes) * block_size
        now = time.monotonic()
        best: tuple[float, str] | None = None
        chosen: WorkerHeartbeat | None = None
        chosen_cached = 0
        for beat in (b for b in owners if not load.overloaded(b)):
            weighted = self.index.weighted_blocks(model, beat.worker_id, hashes, self.policy.tier_weights)
            cached = round(weighted * block_size)
            cost = (prompt_tokens - cached) + self._load_tokens(beat, tier, now)
            if adapter is not None and adapter not in beat.adapters:
                cost += self.policy.tokens_per_adapter_load
            if best is None or (cost, beat.worker_id) < best:
                best, chosen, chosen_cached = (cost, beat.worker_id), beat, cached
        assert chosen is not None
        self._sent.setdefault(chosen.worker_id, []).append(now)
        choice = PartitionChoice(keyed_partition(key, owned_partitions(chosen, topic, partitions)), "cached_prefix")
        return choice, chosen_cached

    def _refusal(
        self, model: str, owners: list[WorkerHeartbeat], load: LoadPolicy, hashes: list[int] | None
    ) -> str | None:
        """Why the index cannot decide (an outcome of ``OUTCOMES``), or None when it can."""
        if hashes is None:
            return "no_tokens"
        if not owners or any(self.index.worker(model, b.worker_id) is None for b in owners):
            return "no_events"
        if not all(self.index.fresh(model, b, max_lag_s=self.policy.max_lag_s) for b in owners):
            return "stale_events"
        if all(load.overloaded(b) for b in owners):
            return "all_busy"
        return None

    def _load_tokens(self, beat: WorkerHeartbeat, tier: Tier, now: float) -> float:
        """The worker's load in prompt tokens: what it reports plus what this router sent it since."""
        beat_age = max(0.0, (time.time() - beat.sent_at.timestamp()))
        since = now - beat_age
        sent = [t for t in self._sent.get(beat.worker_id, ()) if t > since]
        self._sent[beat.worker_id] = sent
        requests = beat.running + beat.waiting + len(sent)
        backlog = (beat.backlog_seconds or {}).get(tier, 0.0)
        return requests * self.policy.tokens_per_request + backlog * self.policy.tokens_per_backlog_s
