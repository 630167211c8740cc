"""One routing decision per request: topic ``llm.<model>.<tier>``, a prefix-affinity key, and an explicit
partition when the workers' KV events show which worker holds the prompt's cached prefix (:mod:`router.kv_routing`)
or when the key's partition belongs to an overloaded worker.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from schemas import InferenceRequest, Names, Tier, WorkerHeartbeat
from sluicegate.api.limits import request_token_cost
from sluicegate.settings import RoutingSettings

from .kv_index import KVIndex
from .kv_routing import CachedPrefixPolicy, KVRouting
from .policy import (
    KeyPolicy,
    LoadPolicy,
    affinity_prefix,
    cap_tier,
    choose_partition,
    key_partition,
    partition_key,
    partition_owners,
)
from .tenant_shares import TenantShares


@dataclass(frozen=True)
class Route:
    """Where to publish one request.

    ``partition`` is None when the key alone decides (the normal, affinity case); ``affinity_partition``
    is where the key hashes to, kept for logs and metrics either way.
    """

    topic: str
    key: bytes
    tier: Tier
    partition: int | None = None
    affinity_partition: int = 0
    reason: str = "affinity"


def route(
    request: InferenceRequest,
    *,
    names: Names,
    partitions: int,
    key_policy: KeyPolicy | None = None,
    max_tier: Tier = "interactive",
    heartbeats: Sequence[WorkerHeartbeat] = (),
    load_policy: LoadPolicy | None = None,
    shares: TenantShares | None = None,
    kv: KVRouting | None = None,
    prompt_ids: Sequence[int] | None = None,
    lora_int_id: int | None = None,
) -> Route:
    """Route ``request``: its priority (capped at ``max_tier``) picks the topic, its prompt prefix the key.

    A request for a LoRA adapter keeps its base model's topic (``request.model``); the adapter only steers
    the partition towards a worker that holds it (:func:`choose_adapter_partition`).
    ``partitions`` is the topic's partition count; ``heartbeats`` are the live workers of the model. With
    ``shares``, the request's tokens are charged to its tenant on the worker that owns the partition it goes to, and
    an overloaded worker sheds only the tenants above an equal share of its recent tokens. With ``kv`` (the workers'
    KV events) and the prompt's token ids as the worker will see them, a request goes to the worker whose cached
    prefix against load costs least; an adapter request does so too when its registry id (``lora_int_id``, which
    seeds its hash chain in every worker's engine) is given, among the workers that serve adapters, else it keeps
    the adapter rules alone.
    """
    tier = cap_tier(request.priority, max_tier)
    topic = names.request_topic(request.model, tier)
    adapter = request.adapter
    key = partition_key(request.model, affinity_prefix(request, key_policy or KeyPolicy()), adapter)
    over_share = functools.partial(shares.over_share, tenant=request.tenant) if shares is not None else None
    load_policy = load_policy or LoadPolicy()
    choice = None
    if kv is not None and (adapter is None or lora_int_id is not None):
        seed = lora_int_id or 0
        hashes = kv.prompt_hashes(request.model, prompt_ids, seed) if prompt_ids is not None else None
        choice, _ = kv.choose(request.model, topic, key, partitions, tier, heartbeats, load_policy, hashes, adapter)
    if choice is None:
        choice = choose_partition(topic, key, partitions, heartbeats, load_policy, adapter, over_share)
    if shares is not None:
        target = choice.partition if choice.partition is not None else key_partition(key, partitions)
        owner = partition_owners(topic, heartbeats).get(target)
        if owner is not None:
            shares.charge(owner.worker_id, request.tenant, request_token_cost(request))
    return Route(
        topic=topic,
        key=key,
        tier=tier,
        partition=choice.partition,
        affinity_partition=key_partition(key, partitions),
        reason=choice.reason,
    )


@dataclass
class Router:
    """Routing state a long-lived process keeps: names, policies, topic sizes and workers' heartbeats.

    Callers refresh heartbeats (``set_heartbeats``) and partition counts (``set_partitions``) as they
    learn them; ``route`` itself never blocks.
    """

    names: Names
    default_partitions: int = 6
    key_policy: KeyPolicy = field(default_factory=KeyPolicy)
    load_policy: LoadPolicy = field(default_factory=LoadPolicy)
    shares: TenantShares | None = None
    kv: KVRouting | None = None
    _partitions: dict[str, int] = field(default_factory=dict)
    _heartbeats: dict[str, list[WorkerHeartbeat]] = field(default_factory=dict)

    @classmethod
    def from_settings(
        cls, settings: RoutingSettings, kv_index: KVIndex | None = None, registry: CollectorRegistry | None = None
    ) -> Router:
        """The router every Sluicegate process builds: prefix, partitions and policies from settings. With
        ``kv_index`` (kept current by a :class:`router.kv_follower.KVFollower`) it routes on cached prefixes, its
        metrics in ``registry`` (the process's)."""
        return cls(
            settings.names,
            default_partitions=settings.topic_partitions,
            key_policy=KeyPolicy(settings.router_prefix_chars, settings.router_prefix_tokens),
            load_policy=LoadPolicy(settings.router_max_waiting, settings.router_min_free_kv),
            shares=TenantShares(settings.router_tenant_half_life_s) if settings.router_tenant_half_life_s > 0 else None,
            kv=KVRouting(
                kv_index,
                CachedPrefixPolicy(
                    settings.router_kv_tokens_per_request,
                    settings.router_kv_tokens_per_backlog_s,
                    max_lag_s=settings.router_kv_max_lag_s,
                ),
                registry=registry,
            )
            if kv_index is not None
            else None,
        )

    def set_partitions(self, topic: str, count: int) -> None:
        """Record a topic's actual partition count (from topic creation or metadata)."""
        if count < 1:
            raise ValueError(f"topic {topic!r}: partition count must be >= 1, got {count}")
        self._partitions[topic] = count

    def partitions(self, topic: str) -> int:
        """The known partition count of ``topic`` (the default until told otherwise)."""
        return self._partitions.get(topic, self.default_partitions)

    def set_heartbeats(self, model: str, heartbeats: Sequence[WorkerHeartbeat]) -> None:
        """Replace the live heartbeats known for ``model``."""
        self._heartbeats[model] = list(heartbeats)

    def heartbeats(self, model: str) -> list[WorkerHeartbeat]:
        """The live heartbeats last set for ``model``."""
        return list(self._heartbeats.get(model, ()))

    def route(
        self,
        request: InferenceRequest,
        *,
        max_tier: Tier = "interactive",
        prompt_ids: Sequence[int] | None = None,
        lora_int_id: int | None = None,
    ) -> Route:
        """Route ``request`` with the state known now; ``prompt_ids``: its prompt's token ids as the worker will
        see them (for routing on the cached prefix); ``lora_int_id``: its adapter's registry id, if any."""
        tier = cap_tier(request.priority, max_tier)
        topic = self.names.request_topic(request.model, tier)
        return route(
            request,
            names=self.names,
            partitions=self.partitions(topic),
            key_policy=self.key_policy,
            max_tier=max_tier,
            heartbeats=self._heartbeats.get(request.model, ()),
            load_policy=self.load_policy,
            shares=self.shares,
            kv=self.kv,
            prompt_ids=prompt_ids,
            lora_int_id=lora_int_id,
        )
