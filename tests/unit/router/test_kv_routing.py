"""Routing on the exact cached prefix: the index built from KV events (snapshots, gaps, bounds, memory), the
choice of the worker whose cached prefix against load costs least, and the fallback to the prompt-prefix key
(counted) when events are missing or stale."""

from __future__ import annotations

import random
import tracemalloc
from datetime import timedelta

from prometheus_client import CollectorRegistry

from router import Router
from router.kv_index import KVIndex, short_hash
from router.kv_routing import CachedPrefixPolicy, KVRouting
from schemas import InferenceRequest, KVBlockStored, KVCacheEvents, Names, PartitionRef, WorkerHeartbeat, utcnow
from sluicegate.block_hashes import prompt_block_hashes

NAMES = Names("p.")
MODEL = "llama"
BLOCK = 4
TOPIC = NAMES.request_topic(MODEL, "standard")


def events(
    worker: str, seq: int, stored: list[bytes], removed: list[bytes] = (), snapshot: bool = False, tier: str = "pool"
):
    return KVCacheEvents(
        model=MODEL,
        worker_id=worker,
        seq=seq,
        tier=tier,
        block_size=BLOCK,
        snapshot=snapshot,
        stored=[KVBlockStored(hash=h.hex()) for h in stored],
        removed=[h.hex() for h in removed],
    )


def beat(worker: str, parts: list[int], seq: int | None, *, waiting: int = 0, age_s: float = 0.0) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        model=MODEL,
        partitions=[PartitionRef(topic=TOPIC, partition=p) for p in parts],
        running=0,
        waiting=waiting,
        free_kv_blocks=100,
        total_kv_blocks=100,
        prefix_cache_hit_rate=0.0,
        kv_events_seq=seq,
        sent_at=utcnow() - timedelta(seconds=age_s),
    )


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_a_snapshot_then_events_build_each_workers_blocks() -> None:
    index = KVIndex()
    a = prompt_block_hashes(ids(41), BLOCK)  # 10 blocks
    assert index.apply(events("w1", 0, a[:4], snapshot=True))
    assert index.apply(events("w1", 1, a[4:8]))
    assert index.matched_blocks(MODEL, "w1", [short_hash(h) for h in a]) == 8
    assert index.apply(events("w1", 2, [], removed=[a[2]]))
    assert index.matched_blocks(MODEL, "w1", [short_hash(h) for h in a]) == 2  # the chain breaks at the gap
    assert index.matched_blocks(MODEL, "w2", [short_hash(h) for h in a]) == 0


def test_a_gap_or_a_late_join_is_out_of_sync_until_a_snapshot() -> None:
    index = KVIndex()
    h = prompt_block_hashes(ids(41), BLOCK)
    assert not index.apply(events("w1", 5, h[:1]))  # joined mid-stream
    assert index.apply(events("w1", 6, h[1:2], snapshot=True))
    assert index.apply(events("w1", 7, h[2:3]))
    assert not index.apply(events("w1", 9, h[3:4]))  # 8 was lost
    assert not index.worker(MODEL, "w1").in_sync
    assert index.apply(events("w1", 10, h[:2], snapshot=True))
    assert index.matched_blocks(MODEL, "w1", [short_hash(x) for x in h]) == 2  # the snapshot replaced the rest


def test_the_index_is_bounded_and_its_memory_measured() -> None:
    index = KVIndex(max_blocks=1000)
    rng = random.Random(0)
    hashes = [rng.randbytes(16) for _ in range(3000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index.apply(events("w1", 0, hashes, snapshot=True))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.num_blocks == 1000
    assert index.matched_blocks(MODEL, "w1", [short_hash(hashes[-1])]) == 1  # the newest kept
    assert index.matched_blocks(MODEL, "w1", [short_hash(hashes[0])]) == 0  # the oldest dropped
    # the estimate covers what the hash set really takes (tracemalloc also counts the message's transient objects)
    assert 40_000 < index.memory_bytes() < 200_000
    assert index.memory_bytes() < used


def _router(index: KVIndex, registry: CollectorRegistry) -> Router:
    router = Router(NAMES, default_partitions=4)
    router.kv = KVRouting(index, CachedPrefixPolicy(tokens_per_request=8.0), registry=registry)
    return router


def _outcome(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("sluicegate_kv_routing_total", {"model": MODEL, "outcome": outcome}) or 0.0


def test_the_next_turn_goes_to_the_worker_holding_its_conversation() -> None:
    index, registry = KVIndex(), CollectorRegistry()
    router = _router(index, registry)
    system = ids(24)  # 6 blocks every conversation shares
    turn1 = system + ids(40, start=500)
    turn2 = turn1 + ids(20, start=900)
    index.apply(events("w1", 0, prompt_block_hashes(system, BLOCK), snapshot=True))
    index.apply(events("w2", 0, prompt_block_hashes(turn1, BLOCK), snapshot=True))  # w2 served turn 1
    router.set_heartbeats(MODEL, [beat("w1", [0, 1], 0), beat("w2", [2, 3], 0)])
    request = InferenceRequest(request_id="r", model=MODEL, prompt=turn2)
    chosen = router.route(request, max_tier="standard", prompt_ids=turn2)
    assert chosen.reason == "cached_prefix" and chosen.partition in (2, 3)
    assert _outcome(registry, "cached_prefix") == 1


def test_load_outweighs_a_short_cached_prefix() -> None:
    index, registry = KVIndex(), CollectorRegistry()
    router = _router(index, registry)
    system = ids(24)
    index.apply(events("w1", 0, prompt_block_hashes(system, BLOCK), snapshot=True))
    index.apply(events("w2", 0, [], snapshot=True))
    prompt = system + ids(8, start=700)
    request = InferenceRequest(request_id="r", model=MODEL, prompt=prompt)
    # w1 holds 24 tokens more; 4 queued requests at 8 tokens each weigh 32: w2 is cheaper
    router.set_heartbeats(MODEL, [beat("w1", [0, 1], 0, waiting=4), beat("w2", [2, 3], 0)])
    assert router.route(request, max_tier="standard", prompt_ids=prompt).partition in (2, 3)
    # the requests it just sent count as load before the next heartbeat shows them
    router.set_heartbeats(MODEL, [beat("w1", [0, 1], 0), beat("w2", [2, 3], 0, waiting=2)])
    picks = [router.route(request, max_tier="standard", prompt_ids=prompt).partition for _ in range(6)]
    assert {p in (0, 1) for p in picks} == {True, False}  # both workers take some


def test_missing_or_stale_events_fall_back_to_the_key_and_say_so() -> None:
    index, registry = KVIndex(), CollectorRegistry()
    router = _router(index, registry)
    prompt = ids(41)
    request = InferenceRequest(request_id="r", model=MODEL, prompt=prompt)
    index.apply(events("w1", 0, prompt_block_hashes(prompt, BLOCK), snapshot=True))
    router.set_heartbeats(MODEL, [beat("w1", [0, 1], 0), beat("w2", [2, 3], 0)])
    assert router.route(request, max_tier="standard", prompt_ids=prompt).reason != "cached_prefix"
    assert _outcome(registry, "no_events") == 1
    index.apply(events("w2", 0, [], snapshot=True))
    # w1's heartbeat, 10 s old, reports seq 3: the router has only 0, so it lost w1's events
    router.set_heartbeats(MODEL, [beat("w1", [0, 1], 3, age_s=10), beat("w2", [2, 3], 0)])
    assert router.route(request, max_tier="standard", prompt_ids=prompt).reason != "cached_prefix"
    assert _outcome(registry, "stale_events") == 1
    # a fresh heartbeat ahead of the index is events still in flight: routed on the cache
    router.set_heartbeats(MODEL, [beat("w1", [0, 1], 3), beat("w2", [2, 3], 0)])
    assert router.route(request, max_tier="standard", prompt_ids=prompt).reason == "cached_prefix"
    # no token ids (no tokenizer published): the key
    assert router.route(request, max_tier="standard").reason != "cached_prefix"
    assert _outcome(registry, "no_tokens") == 1


def test_offload_tiers_count_at_their_weight_and_a_tier_snapshot_replaces_only_that_tier() -> None:
    index = KVIndex()
    a = prompt_block_hashes(list(range(3, 3 + BLOCK * 6 + 1)), BLOCK)  # six blocks
    keys = [short_hash(h) for h in a]
    weights = {"pool": 1.0, "host": 0.9, "disk": 0.5, "shared": 0.25}
    index.apply(events("w1", 0, a[:2], snapshot=True))
    index.apply(events("w1", 1, a[2:4], tier="disk", snapshot=True))
    index.apply(events("w2", 0, [], snapshot=True))
    assert index.apply(events("w2", 1, a[4:], tier="shared"))
    # w1: two pool blocks, two on its disk, then two in the shared store that w2 wrote
    assert index.weighted_blocks(MODEL, "w1", keys, weights) == 2 + 2 * 0.5 + 2 * 0.25
    assert index.weighted_blocks(MODEL, "w2", keys, weights) == 0  # its chain breaks at the first block
    assert index.matched_blocks(MODEL, "w1", keys) == 2  # the pool alone
    index.apply(events("w1", 2, [a[0]], tier="disk", snapshot=True))
    assert index.matched_blocks(MODEL, "w1", keys) == 2  # the pool kept
    assert index.weighted_blocks(MODEL, "w1", keys, weights) == 2
    assert index.worker(MODEL, "w1").in_sync
    assert not index.apply(events("w1", 9, [], tier="host"))  # a gap in the worker's one sequence


def test_an_adapter_request_routes_on_its_own_chain_among_workers_serving_adapters() -> None:
    """The adapter's registry id seeds its chain in every engine: the router hashes the prompt with it, so the worker
    that served the adapter's last turn gets the next; base-model blocks of the same tokens do not count for it."""
    index, registry = KVIndex(), CollectorRegistry()
    router = _router(index, registry)
    turn2 = ids(60)
    with_adapter = dict(serves_adapters=True, adapters=["pirate"])
    beats = [
        beat("w1", [0, 1], 0).model_copy(update=with_adapter),
        beat("w2", [2, 3], 0).model_copy(update=with_adapter),
        beat("w3", [], 0),
    ]
    index.apply(events("w1", 0, prompt_block_hashes(turn2[:40], BLOCK), snapshot=True))  # the base model's
    index.apply(events("w2", 0, prompt_block_hashes(turn2[:40], BLOCK, lora_int_id=7), snapshot=True))
    index.apply(events("w3", 0, [], snapshot=True))
    router.set_heartbeats(MODEL, beats)
    request = InferenceRequest(request_id="r", model=MODEL, adapter="pirate", prompt=turn2)
    chosen = router.route(request, max_tier="standard", prompt_ids=turn2, lora_int_id=7)
    assert chosen.reason == "cached_prefix" and chosen.partition in (2, 3)
    # Another adapter's id names other blocks: none cached anywhere, the tie goes by load and id (w1).
    other = router.route(request, max_tier="standard", prompt_ids=turn2, lora_int_id=8)
    assert other.reason == "cached_prefix" and other.partition in (0, 1)
    # Without the id the adapter rules decide, as before.
    assert router.route(request, max_tier="standard", prompt_ids=turn2).reason.startswith("adapter_")
    # A worker that must load the adapter first pays for it: w2 no longer holds it, w1 does.
    index.apply(events("w1", 1, []))
    router.set_heartbeats(MODEL, [beats[0], beats[1].model_copy(update={"adapters": []}), beats[2]])
    short = ids(12)  # two blocks cached on w2: far less than an adapter load
    index.apply(events("w2", 1, prompt_block_hashes(short, BLOCK, lora_int_id=7)))
    assert router.route(request, max_tier="standard", prompt_ids=short, lora_int_id=7).partition in (0, 1)
