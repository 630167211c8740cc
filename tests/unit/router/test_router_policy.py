"""Routing policy: tiers and caps, prefix-affinity keys, Kafka-compatible partitioning, overload diversion."""

from __future__ import annotations

from datetime import timedelta

import pytest
from aiokafka.partitioner import DefaultPartitioner

from router import KeyPolicy, LoadPolicy, Router, resolve_tier, route
from router.policy import (
    affinity_prefix,
    cap_tier,
    choose_partition,
    key_partition,
    live_heartbeats,
    partition_key,
)
from schemas import ChatMessage, InferenceRequest, Names, PartitionRef, WorkerHeartbeat, utcnow

NAMES = Names("p.")


def chat(*messages: tuple[str, str], model: str = "llama", priority: str = "standard") -> InferenceRequest:
    return InferenceRequest(
        request_id="r1",
        model=model,
        messages=[ChatMessage(role=role, content=text) for role, text in messages],  # type: ignore[arg-type]
        priority=priority,  # type: ignore[arg-type]
    )


def text(prompt: str | list[int], model: str = "llama") -> InferenceRequest:
    return InferenceRequest(request_id="r1", model=model, prompt=prompt)


def beat(
    worker: str, topic: str, partitions: list[int], *, waiting: int = 0, free: int = 100, **kw: object
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        model="llama",
        partitions=[PartitionRef(topic=topic, partition=p) for p in partitions],
        running=kw.pop("running", 1),  # type: ignore[arg-type]
        waiting=waiting,
        free_kv_blocks=free,
        total_kv_blocks=100,
        prefix_cache_hit_rate=0.0,
        **kw,  # type: ignore[arg-type]
    )


# --- tiers -------------------------------------------------------------------------------------------------
def test_tier_defaults_to_the_keys_default() -> None:
    assert resolve_tier(None, default_tier="batch", max_tier="interactive") == "batch"


def test_tier_asked_for_is_granted_within_the_cap() -> None:
    assert resolve_tier("interactive", default_tier="standard", max_tier="interactive") == "interactive"
    assert resolve_tier("batch", default_tier="standard", max_tier="standard") == "batch"


def test_key_capped_at_standard_asking_interactive_gets_standard() -> None:
    assert resolve_tier("interactive", default_tier="standard", max_tier="standard") == "standard"
    assert cap_tier("standard", "batch") == "batch"


def test_unknown_tier_is_an_error_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown tier 'urgent'.*interactive, standard, batch"):
        resolve_tier("urgent", default_tier="standard", max_tier="interactive")


# --- affinity keys -----------------------------------------------------------------------------------------
def test_shared_system_prompt_means_same_key_whatever_the_user_says() -> None:
    policy = KeyPolicy()
    a = chat(("system", "You are a pirate."), ("user", "Hello"))
    b = chat(("system", "You are a pirate."), ("user", "Tell me about ships, at length."))
    c = chat(("system", "You are a lawyer."), ("user", "Hello"))
    key_a = partition_key("llama", affinity_prefix(a, policy))
    assert key_a == partition_key("llama", affinity_prefix(b, policy))
    assert key_a != partition_key("llama", affinity_prefix(c, policy))
    assert key_a != partition_key("mistral", affinity_prefix(a, policy))


def test_conversation_without_system_prompt_keys_on_its_first_message() -> None:
    policy = KeyPolicy()
    turn1 = chat(("user", "Plan a trip to Rome"))
    turn2 = chat(("user", "Plan a trip to Rome"), ("assistant", "Sure..."), ("user", "And Naples?"))
    assert affinity_prefix(turn1, policy) == affinity_prefix(turn2, policy)


def test_text_prompts_key_on_their_first_chars_and_token_prompts_on_first_ids() -> None:
    policy = KeyPolicy(prefix_chars=16, prefix_tokens=4)
    assert affinity_prefix(text("0123456789abcdef-tail-one"), policy) == affinity_prefix(
        text("0123456789abcdef-other"), policy
    )
    assert affinity_prefix(text("0123456789abcdeX"), policy) != affinity_prefix(text("0123456789abcdef"), policy)
    assert affinity_prefix(text([1, 2, 3, 4, 5]), policy) == affinity_prefix(text([1, 2, 3, 4, 9, 9]), policy)
    # A text prompt "1,2" and token ids [1, 2] must not collide.
    assert affinity_prefix(text("1,2"), policy) != affinity_prefix(text([1, 2]), policy)


def test_key_policy_rejects_empty_prefixes() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        KeyPolicy(prefix_chars=0)


def test_key_partition_matches_kafkas_default_partitioner() -> None:
    for i in range(50):
        key = partition_key("m", f"prefix {i}".encode())
        assert key_partition(key, 6) == DefaultPartitioner()(key, list(range(6)), list(range(6)))
    with pytest.raises(ValueError):
        key_partition(b"k", 0)


# --- overload ----------------------------------------------------------------------------------------------
TOPIC = NAMES.request_topic("llama", "standard")


def _home(key: bytes) -> int:
    return key_partition(key, 4)


def test_healthy_owner_keeps_affinity() -> None:
    key = partition_key("llama", b"x")
    beats = [beat("w1", TOPIC, [0, 1, 2, 3])]
    assert choose_partition(TOPIC, key, 4, beats, LoadPolicy()).partition is None


def test_overloaded_owner_diverts_to_least_loaded_workers_partition() -> None:
    key = partition_key("llama", b"x")
    home = _home(key)
    others = [p for p in range(4) if p != home]
    beats = [
        beat("busy", TOPIC, [home], waiting=20),
        beat("idle", TOPIC, others[:1], waiting=0),
        beat("meh", TOPIC, others[1:], waiting=3),
    ]
    choice = choose_partition(TOPIC, key, 4, beats, LoadPolicy(max_waiting=8))
    assert choice.partition == others[0]
    assert choice.reason == "overload"


def test_low_free_kv_or_draining_counts_as_overloaded() -> None:
    policy = LoadPolicy(max_waiting=8, min_free_kv_fraction=0.1)
    assert policy.overloaded(beat("w", TOPIC, [0], free=5))
    assert policy.overloaded(beat("w", TOPIC, [0], draining=True))
    assert not policy.overloaded(beat("w", TOPIC, [0], free=50, waiting=7))


def test_all_busy_or_unowned_keeps_the_key() -> None:
    key = partition_key("llama", b"x")
    home = _home(key)
    others = [p for p in range(4) if p != home]
    busy = [beat("a", TOPIC, [home], waiting=30), beat("b", TOPIC, others, waiting=30)]
    assert choose_partition(TOPIC, key, 4, busy, LoadPolicy()).reason == "affinity_all_busy"
    unowned = [beat("b", TOPIC, others, waiting=0)]
    assert choose_partition(TOPIC, key, 4, unowned, LoadPolicy()).reason == "affinity_unowned"


def test_ownership_of_another_topic_does_not_count() -> None:
    key = partition_key("llama", b"x")
    other_topic = NAMES.request_topic("llama", "batch")
    beats = [beat("busy", TOPIC, [_home(key)], waiting=30), beat("idle", other_topic, [0, 1, 2, 3])]
    assert choose_partition(TOPIC, key, 4, beats, LoadPolicy()).reason == "affinity_all_busy"


def test_live_heartbeats_drop_stale_and_keep_newest_per_worker() -> None:
    now = utcnow()
    old = beat("w1", TOPIC, [0], sent_at=now - timedelta(seconds=30))
    newer = beat("w1", TOPIC, [1], sent_at=now - timedelta(seconds=1))
    newest = beat("w1", TOPIC, [2], sent_at=now)
    other = beat("w2", TOPIC, [3], sent_at=now - timedelta(seconds=2))
    live = live_heartbeats([old, newer, newest, other], max_age_s=6, now=now)
    assert {b.worker_id: b.partitions[0].partition for b in live} == {"w1": 2, "w2": 3}


# --- route / Router ----------------------------------------------------------------------------------------
def test_route_picks_topic_by_model_and_capped_tier() -> None:
    request = chat(("user", "hi"), model="org/Llama 3", priority="interactive")
    r = route(request, names=NAMES, partitions=4, key_policy=KeyPolicy(), max_tier="standard")
    assert r.tier == "standard"
    assert r.topic == NAMES.request_topic("org/Llama 3", "standard")
    assert r.topic.startswith("p.llm.org_Llama_3-")
    assert r.partition is None and r.reason == "affinity_unowned"
    assert r.affinity_partition == key_partition(r.key, 4)


def test_router_uses_its_partition_counts_and_heartbeats() -> None:
    router = Router(NAMES, default_partitions=4)
    request = chat(("system", "sys"), ("user", "hi"))
    r = router.route(request)
    home = r.affinity_partition
    router.set_partitions(TOPIC, 4)
    others = [p for p in range(4) if p != home]
    router.set_heartbeats("llama", [beat("busy", TOPIC, [home], waiting=50), beat("idle", TOPIC, others)])
    diverted = router.route(request)
    assert diverted.reason == "overload" and diverted.partition in others
    assert diverted.key == r.key
    with pytest.raises(ValueError):
        router.set_partitions(TOPIC, 0)
