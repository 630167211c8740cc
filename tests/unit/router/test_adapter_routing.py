"""Routing a request for a LoRA adapter: the base model's topic, a worker holding the adapter first (unless
overloaded), else the least loaded worker (which loads it); the key's affinity only when no worker can take it."""

from __future__ import annotations

from collections.abc import Sequence

from router import LoadPolicy, Router, route
from router.policy import choose_adapter_partition, choose_partition, key_partition, partition_key
from schemas import InferenceRequest, Names, PartitionRef, WorkerHeartbeat

NAMES = Names("p.")
TOPIC = NAMES.request_topic("llama", "standard")
PARTS = 6


def beat(
    worker: str, partitions: list[int], *, adapters: Sequence[str] = (), waiting: int = 0, **kw: object
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        model="llama",
        partitions=[PartitionRef(topic=TOPIC, partition=p) for p in partitions],
        running=kw.pop("running", 1),  # type: ignore[arg-type]
        waiting=waiting,
        free_kv_blocks=kw.pop("free", 100),  # type: ignore[arg-type]
        total_kv_blocks=100,
        prefix_cache_hit_rate=0.0,
        adapters=list(adapters),
        lora=kw.pop("lora", True),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def split(key: bytes) -> tuple[int, list[int]]:
    """The key's home partition and the others."""
    home = key_partition(key, PARTS)
    return home, [p for p in range(PARTS) if p != home]


KEY = partition_key("llama", b"tsome prompt", "sql")


def test_the_adapter_is_part_of_the_key_and_no_adapter_keeps_the_old_key() -> None:
    assert partition_key("llama", b"x") == partition_key("llama", b"x", None)
    assert partition_key("llama", b"x", "sql") != partition_key("llama", b"x")
    assert partition_key("llama", b"x", "sql") != partition_key("llama", b"x", "chat")


def test_a_holder_is_preferred_over_the_keys_owner() -> None:
    home, others = split(KEY)
    beats = [beat("owner", [home]), beat("holder", others[:2], adapters=["sql"])]
    choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(), "sql")
    assert choice.reason == "adapter_resident" and choice.partition in others[:2]
    # The same key always picks the same partition of the holder (a burst sharing a prefix stays together).
    assert choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(), "sql") == choice


def test_a_holder_that_owns_the_keys_partition_keeps_the_key() -> None:
    home, others = split(KEY)
    beats = [beat("a", [home, others[0]], adapters=["sql"]), beat("b", others[1:], adapters=["sql"], waiting=0)]
    choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(), "sql")
    assert (choice.partition, choice.reason) == (None, "adapter_resident")


def test_among_holders_the_least_loaded_one_takes_it() -> None:
    home, others = split(KEY)
    beats = [
        beat("owner", [home]),
        beat("busy-holder", others[:2], adapters=["sql"], waiting=5),
        beat("idle-holder", others[2:], adapters=["sql", "chat"], waiting=1),
    ]
    choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(max_waiting=8), "sql")
    assert choice.reason == "adapter_resident" and choice.partition in others[2:]


def test_an_overloaded_holder_falls_through_to_the_least_loaded_worker() -> None:
    home, others = split(KEY)
    beats = [
        beat("holder", [home], adapters=["sql"], waiting=20),
        beat("meh", others[:2], waiting=3),
        beat("idle", others[2:], waiting=0),
    ]
    choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(max_waiting=8), "sql")
    assert choice.reason == "adapter_load" and choice.partition in others[2:]
    # Draining and a nearly full KV cache count as overloaded too.
    for overloaded in (dict(draining=True), dict(free=1)):
        beats = [beat("holder", others[:1], adapters=["sql"], **overloaded), beat("other", others[1:], waiting=4)]
        choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(max_waiting=8), "sql")
        assert choice.reason == "adapter_load" and choice.partition in others[1:]


def test_without_a_holder_the_least_loaded_worker_loads_it() -> None:
    home, others = split(KEY)
    beats = [beat("owner", [home], waiting=4), beat("idle", others, adapters=["chat"], waiting=0)]
    choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(), "sql")
    assert choice.reason == "adapter_load" and choice.partition in others
    # When that worker owns the key's partition, the key alone sends it there.
    beats = [beat("owner", [home, others[0]], waiting=0), beat("busier", others[1:], waiting=4)]
    assert choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(), "sql").partition is None


def test_all_overloaded_or_none_owning_the_topic_leaves_it_to_the_key() -> None:
    home, others = split(KEY)
    busy = [beat("a", [home], adapters=["sql"], waiting=30), beat("b", others, waiting=30)]
    assert choose_adapter_partition(TOPIC, KEY, PARTS, busy, LoadPolicy(), "sql") is None
    assert choose_partition(TOPIC, KEY, PARTS, busy, LoadPolicy(), "sql").reason == "affinity_all_busy"
    # A holder of the adapter that owns only another tier's partitions does not count.
    other_tier = NAMES.request_topic("llama", "batch")
    elsewhere = WorkerHeartbeat.model_validate(
        beat("h", [], adapters=["sql"]).model_dump() | {"partitions": [PartitionRef(topic=other_tier, partition=0)]}
    )
    assert choose_adapter_partition(TOPIC, KEY, PARTS, [elsewhere], LoadPolicy(), "sql") is None
    assert choose_partition(TOPIC, KEY, PARTS, [elsewhere], LoadPolicy(), "sql").reason == "affinity_unowned"
    assert choose_partition(TOPIC, KEY, PARTS, [], LoadPolicy(), "sql").reason == "affinity_unowned"


def test_only_workers_that_serve_adapters_get_an_adapters_requests() -> None:
    """A worker with LoRA off refuses an adapter's request: never chosen, even idle; when every one that serves
    adapters is overloaded, one of them still gets it rather than the key's LoRA-off owner."""
    home, others = split(KEY)
    beats = [beat("off", [home], waiting=0, lora=False), beat("on", others, waiting=5)]
    choice = choose_partition(TOPIC, KEY, PARTS, beats, LoadPolicy(), "sql")
    assert choice.reason == "adapter_load" and choice.partition in others
    busy = [beat("off", [home], waiting=0, lora=False), beat("on", others, waiting=30)]
    choice = choose_partition(TOPIC, KEY, PARTS, busy, LoadPolicy(max_waiting=8), "sql")
    assert choice.reason == "adapter_load" and choice.partition in others
    # No worker serves adapters: the key decides, as before (the worker's refusal names the setting).
    assert (
        choose_adapter_partition(TOPIC, KEY, PARTS, [beat("off", [home, *others], lora=False)], LoadPolicy(), "sql")
        is None
    )


def test_a_base_model_request_ignores_adapters_in_heartbeats() -> None:
    key = partition_key("llama", b"x")
    home, others = split(key)
    beats = [beat("owner", [home]), beat("holder", others, adapters=["sql"])]
    assert choose_partition(TOPIC, key, PARTS, beats, LoadPolicy()).reason == "affinity"


def test_route_keeps_the_base_models_topic_and_steers_to_the_holder() -> None:
    request = InferenceRequest(request_id="r1", model="llama", prompt="some prompt", adapter="sql")
    plain = route(request, names=NAMES, partitions=PARTS)
    assert plain.topic == TOPIC and plain.reason == "affinity_unowned"
    assert plain.key == KEY
    home, others = split(plain.key)
    router = Router(NAMES, default_partitions=PARTS)
    router.set_heartbeats("llama", [beat("owner", [home]), beat("holder", others, adapters=["sql"])])
    routed = router.route(request)
    assert routed.topic == TOPIC and routed.reason == "adapter_resident" and routed.partition in others
    assert routed.affinity_partition == home
    base = router.route(request.model_copy(update={"adapter": None}))
    assert base.topic == TOPIC and base.reason == "affinity" and base.partition is None
