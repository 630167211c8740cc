"""The router's token shares per tenant and worker: an overloaded worker sheds the tenant that sent it more than an
equal share of its recent tokens and keeps the others' affinity (fairness across workers)."""

from __future__ import annotations

import pytest

from router import KeyPolicy, LoadPolicy, Router
from router.policy import affinity_prefix, choose_partition, key_partition, partition_key
from router.tenant_shares import TenantShares
from schemas import InferenceRequest, Names, PartitionRef, SamplingOptions, WorkerHeartbeat

NAMES = Names("p.")
TOPIC = NAMES.request_topic("llama", "standard")


def beat(worker: str, partitions: list[int], waiting: int = 0) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        model="llama",
        partitions=[PartitionRef(topic=TOPIC, partition=p) for p in partitions],
        running=1,
        waiting=waiting,
        free_kv_blocks=100,
        total_kv_blocks=100,
        prefix_cache_hit_rate=0.0,
    )


def request(tenant: str, prompt: str, max_tokens: int) -> InferenceRequest:
    return InferenceRequest(
        request_id="r", model="llama", prompt=prompt, tenant=tenant, sampling=SamplingOptions(max_tokens=max_tokens)
    )


def test_shares_decay_and_compare_with_an_equal_share() -> None:
    shares = TenantShares(half_life_s=10.0)
    assert shares.over_share("w1", "a", now=0.0)  # nobody else used it: nothing to protect
    shares.charge("w1", "a", 800, now=0.0)
    shares.charge("w1", "b", 100, now=0.0)
    assert shares.over_share("w1", "a", now=0.0) and not shares.over_share("w1", "b", now=0.0)
    assert not shares.over_share("w1", "c", now=0.0)  # a newcomer has used nothing
    shares.charge("w1", "b", 1600, now=10.0)  # a's 800 halved to 400; b now 50 + 1600
    assert shares.over_share("w1", "b", now=10.0) and not shares.over_share("w1", "a", now=10.0)
    assert shares.over_share("w2", "a", now=10.0)  # workers are counted apart
    with pytest.raises(ValueError, match="half_life_s"):
        TenantShares(half_life_s=0)


def test_the_table_stays_bounded() -> None:
    shares = TenantShares(max_tenants_per_worker=3)
    for i, tokens in enumerate((50, 10, 30, 40)):
        shares.charge("w", f"t{i}", tokens, now=0.0)
    assert not shares.over_share("w", "t1", now=0.0)  # t1 (the lightest) made room: it counts as a newcomer
    assert shares.over_share("w", "t0", now=0.0)


def test_an_overloaded_owner_keeps_the_light_tenant_and_sheds_the_heavy_one() -> None:
    key = partition_key("llama", b"shared system prompt")
    home = key_partition(key, 4)
    others = [p for p in range(4) if p != home]
    beats = [beat("owner", [home], waiting=20), beat("relief", others)]
    heavy = choose_partition(TOPIC, key, 4, beats, LoadPolicy(), over_share=lambda worker: True)
    light = choose_partition(TOPIC, key, 4, beats, LoadPolicy(), over_share=lambda worker: False)
    assert heavy.reason == "overload" and heavy.partition in others
    assert (light.partition, light.reason) == (None, "affinity_fair_share")
    calm = [beat("owner", [home]), beat("relief", others)]
    assert choose_partition(TOPIC, key, 4, calm, LoadPolicy(), over_share=lambda worker: True).reason == "affinity"


def test_the_router_charges_what_it_routes_and_diverts_only_the_heavy_tenant() -> None:
    router = Router(NAMES, default_partitions=4, shares=TenantShares(half_life_s=60.0))
    long_prompt = "shared system prompt. " + "x" * 4000
    home = key_partition(partition_key("llama", affinity_prefix(request("a", long_prompt, 1), KeyPolicy())), 4)
    others = [p for p in range(4) if p != home]
    router.set_heartbeats("llama", [beat("owner", [home]), beat("relief", others)])
    for _ in range(8):  # tenant a's long prompts, all keyed to the owner while it keeps up
        assert router.route(request("a", long_prompt, 256), max_tier="standard").reason == "affinity"
    assert router.route(request("b", long_prompt, 16), max_tier="standard").reason == "affinity"
    router.set_heartbeats("llama", [beat("owner", [home], waiting=20), beat("relief", others)])
    shed = router.route(request("a", long_prompt, 256), max_tier="standard")
    kept = router.route(request("b", long_prompt, 16), max_tier="standard")
    assert shed.reason == "overload" and shed.partition in others
    assert (kept.partition, kept.reason) == (None, "affinity_fair_share")


def test_without_shares_every_request_is_diverted_as_before() -> None:
    router = Router(NAMES, default_partitions=4)
    prompt = "p" * 100
    home = key_partition(partition_key("llama", affinity_prefix(request("b", prompt, 1), KeyPolicy())), 4)
    others = [p for p in range(4) if p != home]
    router.set_heartbeats("llama", [beat("owner", [home], waiting=20), beat("relief", others)])
    assert router.route(request("b", prompt, 16), max_tier="standard").reason == "overload"
