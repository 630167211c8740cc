"""Pure routing policy: which tier a request may use, which partition key gives it prefix affinity,
whether that partition's owner is too busy so another worker's partition should take it, and which worker's
partition a request for a LoRA adapter goes to (one that holds the adapter, else the least loaded).

Nothing here does I/O; :mod:`router.router` combines these into one routing decision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from aiokafka.partitioner import murmur2

from schemas import InferenceRequest, Tier, WorkerHeartbeat, tier_rank, utcnow

# Roles whose leading run forms the prompt prefix shared across a deployment's requests.
_PREAMBLE_ROLES = frozenset({"system", "developer"})


def check_tier(tier: str) -> Tier:
    """``tier`` itself when it names a tier; ``ValueError`` naming the valid ones otherwise."""
    tier_rank(tier)
    return tier  # type: ignore[return-value]


def cap_tier(tier: Tier, max_tier: Tier) -> Tier:
    """``tier``, lowered to ``max_tier`` when it ranks above it."""
    return tier if tier_rank(tier) >= tier_rank(max_tier) else max_tier


def resolve_tier(requested: str | None, *, default_tier: Tier, max_tier: Tier) -> Tier:
    """The tier a request gets: what it asked for (or the key's default), capped at the key's maximum.

    A key capped at ``standard`` that asks for ``interactive`` gets ``standard``; an unknown name is a
    ``ValueError``, not a silent default.
    """
    return cap_tier(check_tier(requested if requested is not None else default_tier), max_tier)


@dataclass(frozen=True)
class KeyPolicy:
    """How much of a prompt decides its partition.

    Long enough to tell different system prompts apart, short enough that requests sharing a preamble
    agree: a prefix-cache hit needs the same leading blocks on the same worker.
    """

    prefix_chars: int = 2048
    prefix_tokens: int = 64

    def __post_init__(self) -> None:
        if self.prefix_chars < 1 or self.prefix_tokens < 1:
            raise ValueError("prefix_chars and prefix_tokens must be >= 1")


def affinity_prefix(request: InferenceRequest, policy: KeyPolicy) -> bytes:
    """The leading part of the prompt that the partition key hashes.

    Chat requests use their leading system/developer messages (the part a deployment repeats on every
    call), or the first message when there is none (so a conversation's turns stay together). Text
    prompts use their first ``prefix_chars`` characters, token prompts their first ``prefix_tokens`` ids.
    A one-byte kind tag keeps the three forms from colliding.
    """
    if request.messages is not None:
        preamble = []
        for message in request.messages:
            if message.role not in _PREAMBLE_ROLES:
                break
            preamble.append(message)
        chosen = preamble or request.messages[:1]
        # Record/unit separators cannot be confused with message text boundaries.
        text = "\x1e".join(f"{m.role}\x1f{m.text()}" for m in chosen)
        return b"m" + text[: policy.prefix_chars].encode()
    if isinstance(request.prompt, str):
        return b"t" + request.prompt[: policy.prefix_chars].encode()
    assert request.prompt is not None  # guaranteed by InferenceRequest's validator
    return b"i" + ",".join(map(str, request.prompt[: policy.prefix_tokens])).encode()


def partition_key(model: str, prefix: bytes, adapter: str | None = None) -> bytes:
    """The Kafka record key: a hex digest of model, adapter (if any) and prompt prefix (fixed length, log-friendly).

    The adapter is part of it because the engine's prefix cache is per adapter: a base-model request and an
    adapter request sharing a preamble share no cached blocks, so nothing is gained by keeping them together.
    """
    head = model.encode() if adapter is None else model.encode() + b"\x00lora\x00" + adapter.encode()
    digest = hashlib.sha256(head + b"\x00" + prefix).hexdigest()
    return digest[:32].encode()


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (Java and aiokafka alike) sends ``key`` to."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass(frozen=True)
class LoadPolicy:
    """When a worker counts as overloaded, from its latest heartbeat."""

    max_waiting: int = 8
    min_free_kv_fraction: float = 0.05

    def overloaded(self, heartbeat: WorkerHeartbeat) -> bool:
        """Draining, too many queued sequences, or almost no free KV blocks left."""
        if heartbeat.draining or heartbeat.waiting >= self.max_waiting:
            return True
        return heartbeat.total_kv_blocks > 0 and free_fraction(heartbeat) < self.min_free_kv_fraction


def free_fraction(heartbeat: WorkerHeartbeat) -> float:
    """Share of the worker's KV blocks that are free (1.0 when it reports none at all)."""
    if heartbeat.total_kv_blocks == 0:
        return 1.0
    return heartbeat.free_kv_blocks / heartbeat.total_kv_blocks


def load_score(heartbeat: WorkerHeartbeat) -> tuple[int, float, int, str]:
    """Sort key, least loaded first: queue length, then KV pressure, then running, then id (ties)."""
    return (heartbeat.waiting, -free_fraction(heartbeat), heartbeat.running, heartbeat.worker_id)


def live_heartbeats(
    heartbeats: Iterable[WorkerHeartbeat], *, max_age_s: float, now: datetime | None = None
) -> list[WorkerHeartbeat]:
    """The heartbeats sent within ``max_age_s``, newest per worker."""
    cutoff = (now or utcnow()) - timedelta(seconds=max_age_s)
    newest: dict[str, WorkerHeartbeat] = {}
    for beat in heartbeats:
        if beat.sent_at < cutoff:
            continue
        seen = newest.get(beat.worker_id)
        if seen is None or beat.sent_at > seen.sent_at:
            newest[beat.worker_id] = beat
    return list(newest.values())


@dataclass(frozen=True)
class PartitionChoice:
    """An explicit partition (None: let the key decide) and why."""

    partition: int | None
    reason: str


def owned_partitions(beat: WorkerHeartbeat, topic: str, partitions: int) -> list[int]:
    """The partitions of ``topic`` (below ``partitions``) that ``beat``'s worker owns, sorted."""
    return sorted({r.partition for r in beat.partitions if r.topic == topic and r.partition < partitions})


def partition_owners(topic: str, heartbeats: Sequence[WorkerHeartbeat]) -> dict[int, WorkerHeartbeat]:
    """Each partition of ``topic`` that a live heartbeat claims, with that heartbeat."""
    owners: dict[int, WorkerHeartbeat] = {}
    for beat in heartbeats:
        for ref in beat.partitions:
            if ref.topic == topic:
                owners[ref.partition] = beat
    return owners


def keyed_partition(key: bytes, choices: Sequence[int]) -> int:
    """One of ``choices`` picked by the key, so a burst sharing a prefix lands on one partition of a worker."""
    return choices[(murmur2(key) & 0x7FFFFFFF) % len(choices)]


def choose_partition(
    topic: str,
    key: bytes,
    partitions: int,
    heartbeats: Sequence[WorkerHeartbeat],
    policy: LoadPolicy,
    adapter: str | None = None,
    over_share: Callable[[str], bool] | None = None,
) -> PartitionChoice:
    """Keep the key's partition unless its owner is overloaded and a less loaded worker exists.

    ``over_share(worker_id)`` says whether the request's tenant took more than an equal share of that worker's
    recent tokens (:class:`router.tenant_shares.TenantShares`): an overloaded owner keeps the requests of tenants
    that did not (``affinity_fair_share``) and sheds those of the ones that did.

    A request for a LoRA ``adapter`` first goes to a worker that has the adapter loaded (see
    :func:`choose_adapter_partition`); only when no worker can take it that way does the key decide.

    When diverting, the key still picks among the chosen worker's partitions of ``topic``, so a burst
    sharing one prefix lands on one partition of the relief worker rather than spraying across it.
    Partitions nobody owns (no live heartbeat claims them) keep the key: Kafka holds the backlog.
    """
    if adapter is not None:
        chosen = choose_adapter_partition(topic, key, partitions, heartbeats, policy, adapter)
        if chosen is not None:
            return chosen
    home = key_partition(key, partitions)
    owner = partition_owners(topic, heartbeats).get(home)
    if owner is None:
        return PartitionChoice(None, "affinity_unowned")
    if not policy.overloaded(owner):
        return PartitionChoice(None, "affinity")
    if over_share is not None and not over_share(owner.worker_id):
        return PartitionChoice(None, "affinity_fair_share")
    candidates = [
        b
        for b in heartbeats
        if b.worker_id != owner.worker_id and not policy.overloaded(b) and owned_partitions(b, topic, partitions)
    ]
    if not candidates:
        return PartitionChoice(None, "affinity_all_busy")
    relief = min(candidates, key=load_score)
    return PartitionChoice(keyed_partition(key, owned_partitions(relief, topic, partitions)), "overload")


def choose_adapter_partition(
    topic: str,
    key: bytes,
    partitions: int,
    heartbeats: Sequence[WorkerHeartbeat],
    policy: LoadPolicy,
    adapter: str,
) -> PartitionChoice | None:
    """Where a request for ``adapter`` goes, before prefix affinity is considered; None to let the key decide.

    Only workers that serve adapters count (``WorkerHeartbeat.serves_adapters``): one with LoRA off refuses the
    request. A worker whose heartbeat lists the adapter serves it without loading it first: among such workers
    that are not overloaded, the key's own partition when one of them owns it (prefix affinity among the holders),
    else the least loaded holder (``adapter_resident``). With no such holder, the least loaded worker that is
    not overloaded, which loads the adapter on demand (``adapter_load``). When every worker that could serve it
    is overloaded, still one of them if some owner of ``topic`` could not; None when every owner could and is
    overloaded, or none can or owns a partition: then the ordinary rules keep the key's partition.
    """
    owners = [b for b in heartbeats if owned_partitions(b, topic, partitions)]
    capable = [b for b in owners if b.serves_adapters]
    able = [b for b in capable if not policy.overloaded(b)]
    if not able and len(capable) < len(owners):
        able = capable  # the key could pick a worker that cannot serve it at all: a busy one that can is better
    if not able:
        return None
    holders = [b for b in able if adapter in b.adapters]
    if holders:
        home_owner = partition_owners(topic, holders).get(key_partition(key, partitions))
        if home_owner is not None:
            return PartitionChoice(None, "adapter_resident")
        best = min(holders, key=load_score)
        return PartitionChoice(keyed_partition(key, owned_partitions(best, topic, partitions)), "adapter_resident")
    loader = min(able, key=load_score)
    if key_partition(key, partitions) in owned_partitions(loader, topic, partitions):
        return PartitionChoice(None, "adapter_load")
    return PartitionChoice(keyed_partition(key, owned_partitions(loader, topic, partitions)), "adapter_load")


def expected_start_s(tier: Tier, heartbeats: Iterable[WorkerHeartbeat]) -> float | None:
    """Seconds until a new request of ``tier`` is expected to start: the smallest backlog at or above its tier
    that a live, not draining worker reports (the kindest reading: a request is refused only when not even the
    least loaded worker would start it in time); None when no worker reports one."""
    known = [
        beat.backlog_seconds[tier]
        for beat in heartbeats
        if not beat.draining and beat.backlog_seconds is not None and tier in beat.backlog_seconds
    ]
    return min(known) if known else None


def deadline_unmeetable(
    request: InferenceRequest, tier: Tier, heartbeats: Iterable[WorkerHeartbeat], now: datetime | None = None
) -> str | None:
    """Why ``request``'s deadline cannot be met by the backlog its model's workers report, or None (no deadline,
    no estimate, or time enough). A deadline is the time after which a request is not started."""
    if request.deadline is None:
        return None
    wait_s = expected_start_s(tier, heartbeats)
    if wait_s is None:
        return None
    left_s = (request.deadline - (now or utcnow())).total_seconds()
    if wait_s <= left_s:
        return None
    return (
        f"the deadline {request.deadline.isoformat()} is {left_s:.1f} s away, but model '{request.model}' has "
        f"{wait_s:.1f} s of work queued at or above the '{tier}' tier: the request would not start in time"
    )
