"""The worker serving LoRA adapters on real Kafka and Redis: adapters named at start are registered and
preloaded, others load on demand from the registry (an fsspec URL fetched to the worker's cache), each request gets
exactly the tokens ``LLM.generate(..., lora_request=...)`` gives, an unknown or broken adapter fails only its own
request, heartbeats list the adapters held, registrations are verified by the worker, and a request resumed after
a crash continues with its adapter.

Adapters are made with ``peft`` on the random tiny model, with random non-zero A and B, so they change the output.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import fsspec
import pytest
from needs import require_import
from redis.asyncio import Redis
from safetensors.torch import load_file, save_file
from test_worker import (
    MODEL,
    PROMPT,
    publish,
    running_worker,
    wait_terminal,
    write_partial_stream,
)
from transformers import AutoConfig

from benchmarks.lora import make_adapter as make_peft_adapter
from gpu_workers.engine import LLM, AsyncEngine, SamplingParams
from gpu_workers.engine.lora.request import LoRARequest
from gpu_workers.worker.adapters import AdapterError, Adapters
from gpu_workers.worker.streams import StreamPublisher
from schemas import ErrorEvent, InferenceRequest, Names, SamplingOptions, TokenEvent, WorkerHeartbeat
from sluicegate.lora.checks import ask_check
from sluicegate.lora.registry import LoRARegistry

require_import("peft")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MAX_TOKENS = 24
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter for ``base`` on every projection, big enough (std 0.2) to change the tokens."""
    return make_peft_adapter(base, out, rank, targets=TARGETS, seed=seed, std=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lora-worker-model") / MODEL, num_layers=2, hidden_size=64)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    broken = root / "broken"
    make_adapter(model_dir, broken, rank=4, seed=3)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # a truncated download
    return {
        "sql": make_adapter(model_dir, root / "sql", rank=4, seed=1),
        "chat": make_adapter(model_dir, root / "chat", rank=8, seed=2),
        "broken": broken,
    }


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """Greedy tokens of the offline engine for the prompt: base model and each good adapter."""
    llm = LLM(str(model_dir), device="cpu", cpu_kv_cache_gb=0.05, enable_lora=True, max_lora_rank=8)
    prompt = list(llm.tokenizer.encode(PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [None, LoRARequest("sql", 1, str(adapters["sql"])), LoRARequest("chat", 2, str(adapters["chat"]))]
    outputs = llm.generate([prompt] * 3, params, lora_request=loras)
    tokens = {(lora.lora_name if lora else None): list(out.token_ids) for lora, out in zip(loras, outputs, strict=True)}
    assert tokens["sql"] != tokens[None] and tokens["chat"] != tokens[None] and tokens["sql"] != tokens["chat"]
    return tokens


def request_for(adapter: str | None, n: int = 1) -> InferenceRequest:
    return InferenceRequest(
        request_id=uuid.uuid4().hex,
        model=MODEL,
        prompt=PROMPT,
        adapter=adapter,
        sampling=SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n),
    )


def tokens_of(events: list) -> list[int]:
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


async def heartbeat_adapters(redis: Redis, names: Names, wanted: set[str], timeout_s: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout_s
    held: list[str] = []
    while time.monotonic() < deadline:
        raw = await redis.hget(names.workers_key(MODEL), "w-int")
        held = WorkerHeartbeat.model_validate_json(raw).adapters if raw else []
        if wanted <= set(held):
            return held
        await asyncio.sleep(0.1)
    raise AssertionError(f"heartbeats list {held}, not {sorted(wanted)}")


async def test_worker_serves_named_and_registered_adapters_and_fails_bad_ones_alone(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,
    adapters: dict[str, Path],
    reference: dict[str | None, list[int]],
    unique_prefix: str,
    tmp_path: Path,
) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    registry = LoRARegistry(redis, unique_prefix)
    # "chat" lives behind an fsspec URL, as on object storage; the worker fetches it to its cache.
    chat_url = f"memory://lora-{uuid.uuid4().hex}/chat"
    memory = fsspec.filesystem("memory")
    for file in adapters["chat"].iterdir():
        memory.pipe_file(f"{chat_url}/{file.name}", file.read_bytes())
    cache = tmp_path / "cache"
    try:
        async with running_worker(
            kafka_bootstrap,
            redis_url,
            model_dir,
            unique_prefix,
            worker_loras={"sql": str(adapters["sql"])},
            max_lora_rank=8,
            lora_cache_dir=str(cache),
        ) as worker:
            # Named at start: registered (with its rank, as the worker read it) and already loaded.
            sql = await registry.get("sql")
            assert sql is not None and (sql.base_model, sql.path, sql.rank) == (MODEL, str(adapters["sql"]), 4)
            assert await heartbeat_adapters(redis, names, {"sql"}) == ["sql"]

            # Registration checks are answered by the worker against its model.
            ok = await ask_check(redis, unique_prefix, MODEL, "chat", chat_url, timeout=30)
            assert ok.ok and ok.rank == 8
            refused = await ask_check(redis, unique_prefix, MODEL, "broken", str(adapters["broken"]), timeout=30)
            assert not refused.ok and refused.reason and "\n" not in refused.reason
            await registry.register("chat", MODEL, chat_url, rank=8)
            await registry.register("broken", MODEL, str(adapters["broken"]))
            await registry.register("other-model", "some-other-model", str(adapters["sql"]))

            tuned = {name: request_for(name) for name in ("sql", "chat")}
            plain = request_for(None)
            bad = {name: request_for(name) for name in ("nope", "broken", "other-model")}
            await publish(worker, tuned["sql"], bad["nope"], tuned["chat"], bad["broken"], plain, bad["other-model"])

            for name, request in tuned.items():
                events = await wait_terminal(redis, names, request.request_id)
                assert events[-1].type == "done", events[-1]
                assert tokens_of(events) == reference[name], name
            assert tokens_of(await wait_terminal(redis, names, plain.request_id)) == reference[None]
            codes = {}
            for name, request in bad.items():
                events = await wait_terminal(redis, names, request.request_id)
                assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
                codes[name] = events[0].code
                assert f"'{name}'" in events[0].message and "\n" not in events[0].message
            assert codes == {
                "nope": "adapter_not_found",
                "broken": "adapter_load_failed",
                "other-model": "adapter_not_found",
            }
            # Loaded on demand and advertised; fetched once into the cache.
            assert await heartbeat_adapters(redis, names, {"sql", "chat"}) == ["chat", "sql"]
            chat = await registry.get("chat")
            assert chat is not None
            fetched = [p.name for p in cache.iterdir() if p.name != "checks"]
            assert len(fetched) == 1 and fetched[0].startswith(f"{chat.lora_int_id}-")
            assert not worker.task.done()
    finally:
        await redis.aclose()


async def test_a_resumed_adapter_request_continues_with_its_adapter(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,
    adapters: dict[str, Path],
    reference: dict[str | None, list[int]],
    unique_prefix: str,
    tmp_path: Path,
) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    try:
        async with running_worker(
            kafka_bootstrap,
            redis_url,
            model_dir,
            unique_prefix,
            enable_lora=True,
            max_lora_rank=8,
            lora_cache_dir=str(tmp_path / "cache"),
        ) as worker:
            await LoRARegistry(redis, unique_prefix).register("sql", MODEL, str(adapters["sql"]))
            # An uninterrupted run gives the deltas a crashed worker would have streamed...
            whole = request_for("sql")
            await publish(worker, whole)
            full = await wait_terminal(redis, names, whole.request_id)
            deltas = [(e.text, list(e.token_ids)) for e in full if isinstance(e, TokenEvent)]
            assert [t for _, ids in deltas for t in ids] == reference["sql"]
            # ...and a request re-delivered after a crash, its stream cut after some deltas, ends exactly as it
            # would have: the resumed request carries its adapter.
            resumed = request_for("sql")
            await write_partial_stream(redis, names, resumed.request_id, deltas[: len(deltas) // 2])
            await publish(worker, resumed)
            events = await wait_terminal(redis, names, resumed.request_id)
            assert events[-1].type == "done" and tokens_of(events) == reference["sql"]
            assert [e.seq for e in events] == list(range(len(events)))
            assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "".join(t for t, _ in deltas)
            # n = 2: each choice cut at its own point, each resumed as its own engine request with the adapter.
            choices = request_for("sql", n=2)
            publisher = StreamPublisher(redis, names, ttl_s=600)
            seq = 0
            for step, (text, ids) in enumerate(deltas):
                for index, cut in enumerate((3, len(deltas) - 2)):
                    if step < cut:
                        publisher.add(
                            TokenEvent(request_id=choices.request_id, seq=seq, text=text, token_ids=ids, index=index)
                        )
                        seq += 1
            await publisher.flush()
            await publish(worker, choices)
            events = await wait_terminal(redis, names, choices.request_id)
            assert events[-1].type == "done"
            for index in (0, 1):
                got = [t for e in events if isinstance(e, TokenEvent) and e.index == index for t in e.token_ids]
                assert got == reference["sql"], index
            assert not worker.task.done()
    finally:
        await redis.aclose()


async def test_adapters_load_once_stay_private_and_follow_a_new_registration(
    redis_url: str, model_dir: Path, adapters: dict[str, Path], unique_prefix: str, tmp_path: Path
) -> None:
    redis = Redis.from_url(redis_url)
    registry = LoRARegistry(redis, unique_prefix)
    url = f"memory://lora-{uuid.uuid4().hex}/sql"
    for file in adapters["sql"].iterdir():
        fsspec.filesystem("memory").pipe_file(f"{url}/{file.name}", file.read_bytes())
    engine = AsyncEngine(str(model_dir), device="cpu", cpu_kv_cache_gb=0.05, enable_lora=True, max_lora_rank=8)
    await engine.start()
    try:
        served = Adapters(
            engine,
            registry,
            model_name=MODEL,
            cache_dir=tmp_path / "cache",
            max_lora_rank=8,
            model_config=lambda: AutoConfig.from_pretrained(str(model_dir)),
            lookup_ttl_s=0.0,
        )
        # The check before registration reads the tensors as a load would: a NaN weight is refused there, not
        # registered to fail every request that names it.
        assert (await served.verify("sql", str(adapters["sql"]))).ok
        poisoned = tmp_path / "poisoned"
        shutil.copytree(adapters["sql"], poisoned)
        weights = load_file(str(poisoned / "adapter_model.safetensors"))
        first_key = sorted(weights)[0]
        weights[first_key] = weights[first_key].clone().fill_(float("nan"))
        save_file(weights, str(poisoned / "adapter_model.safetensors"))
        refusal = await served.verify("poisoned", str(poisoned))
        assert not refusal.ok and "NaN or infinite" in (refusal.reason or ""), refusal
        first = await registry.register("sql", MODEL, url, tenant="acme")
        mine = request_for("sql").model_copy(update={"tenant": "acme"})
        # Many requests at once: one fetch, one load.
        loras = await asyncio.gather(*(served.resolve(mine) for _ in range(8)))
        assert {lora.lora_int_id for lora in loras} == {first.lora_int_id}
        assert [(x.lora_name, x.lora_int_id) for x in await engine.list_loras()] == [("sql", first.lora_int_id)]
        assert len(list((tmp_path / "cache").iterdir())) == 1
        # Looked up within the TTL and loaded: ready without I/O (the engine may start it early).
        served.lookup_ttl_s = 60.0
        assert served.ready(mine) == loras[0] and served.ready(request_for(None)) is None
        # Private: another tenant is told it does not exist.
        theirs = mine.model_copy(update={"tenant": "other"})
        assert served.ready(theirs) is None
        with pytest.raises(AdapterError) as refused:
            await served.resolve(theirs)
        assert refused.value.code == "adapter_not_found"
        served.lookup_ttl_s = 0.0  # from here on every request looks the registry up again
        # Unloaded and registered again (a new id, other files): the new registration is served, the old
        # weights leave the engine.
        assert await registry.unregister("sql")
        second = await registry.register("sql", MODEL, str(adapters["chat"]))
        lora = await served.resolve(mine)
        assert (lora.lora_int_id, lora.lora_path) == (second.lora_int_id, str(adapters["chat"]))
        await served.refresh()
        assert served.names() == ["sql"]
        assert [x.lora_int_id for x in await engine.list_loras()] == [second.lora_int_id]
        # Unregistered for good: requests fail, and the engine lets go of it.
        assert await registry.unregister("sql")
        with pytest.raises(AdapterError, match="does not exist"):
            await served.resolve(mine)
        assert await engine.list_loras() == []
    finally:
        await engine.shutdown()
        await redis.aclose()
