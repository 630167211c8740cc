"""The LoRA registry and the load-time check against a real Redis: ids from one counter, one registration per
name, the request-reply of a check with a worker-side verify function, and the 503 path when nobody answers; the
resolver's cached snapshot; the usage rollup's rows per adapter."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from ingress_support import delete_prefixed_keys
from lora_support import config_checker, write_adapter
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import InferenceRequest, Names, Usage, UsageRecord
from sluicegate.lora.checks import AdapterCheck, CheckVerdict, NoCheckerError, ask_check, serve_checks
from sluicegate.lora.registry import AdapterExistsError, LoRARegistry
from sluicegate.lora.resolve import AdapterResolver, Resolved, UnknownAdapterError
from sluicegate.redis_client import create_redis
from sluicegate.task_stop import cancel_and_wait
from sluicegate.usage.ledger import usage_record
from sluicegate.usage.report import usage_report
from sluicegate.usage.rollup import UsageAggregates

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_register_get_list_unregister(redis: Redis, unique_prefix: str) -> None:
    registry = LoRARegistry(redis, unique_prefix)
    first = await registry.register("sql", "tiny", "/adapters/sql", rank=8)
    second = await registry.register("chat", "tiny", "s3://b/chat", tenant="acme")
    other = await registry.register("law", "big", "/adapters/law")
    assert (first.lora_int_id, second.lora_int_id, other.lora_int_id) == (1, 2, 3)
    assert await registry.get("sql") == first and first.rank == 8 and first.tenant is None
    assert (await registry.get("chat")).tenant == "acme"  # type: ignore[union-attr]
    assert [a.name for a in await registry.list()] == ["chat", "law", "sql"]
    assert [a.name for a in await registry.list(base_model="tiny")] == ["chat", "sql"]
    assert await registry.unregister("sql") is True
    assert await registry.unregister("sql") is False
    assert await registry.get("sql") is None
    # A name registered again gets a new id, so a worker still holding the old files cannot confuse the two.
    again = await registry.register("sql", "tiny", "/adapters/sql-v2")
    assert again.lora_int_id == 4 and again.path == "/adapters/sql-v2"


async def test_duplicate_name_is_a_409_and_keeps_the_first(redis: Redis, unique_prefix: str) -> None:
    registry = LoRARegistry(redis, unique_prefix)
    first = await registry.register("sql", "tiny", "/a")
    with pytest.raises(AdapterExistsError) as info:
        await registry.register("sql", "tiny", "/b")
    assert info.value.status == 409 and "already registered" in info.value.message
    assert await registry.get("sql") == first
    # Concurrent registrations of one name: exactly one wins.
    results = await asyncio.gather(
        *(registry.register("race", "tiny", f"/r{i}") for i in range(5)), return_exceptions=True
    )
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, AdapterExistsError) for r in results if isinstance(r, BaseException))


async def test_invalid_registration_writes_nothing(redis: Redis, unique_prefix: str) -> None:
    registry = LoRARegistry(redis, unique_prefix)
    with pytest.raises(ValidationError, match="name"):
        await registry.register("has space", "tiny", "/a")
    with pytest.raises(ValidationError, match="path"):
        await registry.register("ok", "tiny", "")
    names = Names(unique_prefix)
    assert await redis.exists(names.lora_adapters_key, names.lora_next_id_key) == 0


async def test_corrupt_entry_is_skipped_not_fatal(redis: Redis, unique_prefix: str) -> None:
    registry = LoRARegistry(redis, unique_prefix)
    await registry.register("good", "tiny", "/g")
    await redis.hset(Names(unique_prefix).lora_adapters_key, "bad", b"{not json")
    assert await registry.get("bad") is None
    assert [a.name for a in await registry.list()] == ["good"]


async def test_check_is_answered_by_a_serving_worker(redis: Redis, unique_prefix: str, tmp_path: Path) -> None:
    good = write_adapter(tmp_path, "good", rank=4)
    wrong_base = write_adapter(tmp_path, "wrong", base="other-model")
    server = asyncio.create_task(serve_checks(redis, unique_prefix, "tiny", config_checker("tiny")))
    try:
        verdict = await ask_check(redis, unique_prefix, "tiny", "good", str(good), timeout=5)
        assert verdict == CheckVerdict(ok=True, reason=None, rank=4)
        refused = await ask_check(redis, unique_prefix, "tiny", "wrong", str(wrong_base), timeout=5)
        assert not refused.ok and "other-model" in (refused.reason or "")
        missing = await ask_check(redis, unique_prefix, "tiny", "gone", str(tmp_path / "nope"), timeout=5)
        assert not missing.ok and "no adapter_config.json" in (missing.reason or "")
    finally:
        await cancel_and_wait(server)
    names = Names(unique_prefix)
    assert await redis.llen(names.lora_checks_key("tiny")) == 0


async def test_a_verify_that_raises_is_a_one_line_refusal(redis: Redis, unique_prefix: str) -> None:
    async def broken(name: str, path: str) -> CheckVerdict:
        raise ValueError(f"{name}: header\nspans lines")

    server = asyncio.create_task(serve_checks(redis, unique_prefix, "tiny", broken))
    try:
        verdict = await ask_check(redis, unique_prefix, "tiny", "x", "/x", timeout=5)
    finally:
        await cancel_and_wait(server)
    assert verdict.ok is False and verdict.reason == "x: header spans lines"


async def test_no_worker_answering_times_out_and_withdraws_the_check(redis: Redis, unique_prefix: str) -> None:
    started = time.monotonic()
    with pytest.raises(NoCheckerError, match="no worker of model 'tiny'"):
        await ask_check(redis, unique_prefix, "tiny", "x", "/x", timeout=1.5)
    assert 1.4 < time.monotonic() - started < 4
    assert await redis.llen(Names(unique_prefix).lora_checks_key("tiny")) == 0


async def test_worker_drops_checks_whose_asker_gave_up(redis: Redis, unique_prefix: str) -> None:
    names = Names(unique_prefix)
    stale = AdapterCheck(check_id="stale1", base_model="tiny", name="x", path="/x", deadline=time.time() - 1)
    await redis.rpush(names.lora_checks_key("tiny"), stale.model_dump_json(), b"not json")
    calls: list[str] = []

    async def verify(name: str, path: str) -> CheckVerdict:
        calls.append(name)
        return CheckVerdict(ok=True)

    server = asyncio.create_task(serve_checks(redis, unique_prefix, "tiny", verify))
    try:
        # A fresh check after the stale and the malformed one is still answered: bad input loses nothing else.
        verdict = await ask_check(redis, unique_prefix, "tiny", "fresh", "/f", timeout=5)
    finally:
        await cancel_and_wait(server)
    assert verdict.ok and calls == ["fresh"]
    assert await redis.exists(names.lora_verdict_key("stale1")) == 0


async def test_resolver_caches_for_its_ttl_and_invalidates(redis: Redis, unique_prefix: str) -> None:
    now = [0.0]
    registry = LoRARegistry(redis, unique_prefix)
    resolver = AdapterResolver(registry, ttl_s=5.0, clock=lambda: now[0])
    assert await resolver.resolve("sql", tenant="t") == Resolved("sql")  # nothing registered yet
    await LoRARegistry(redis, unique_prefix).register("sql", "tiny", "/a")  # as another ingress would
    assert await resolver.resolve("sql", tenant="t") == Resolved("sql")  # the snapshot is still fresh
    now[0] = 5.1
    assert await resolver.resolve("sql", tenant="t") == Resolved("tiny", "sql")
    await registry.unregister("sql")
    resolver.invalidate()  # this process's own unload is seen at once
    assert await resolver.resolve("sql", tenant="t") == Resolved("sql")


async def test_resolver_rereads_for_an_explicit_adapter_and_filters_by_tenant(redis: Redis, unique_prefix: str) -> None:
    registry = LoRARegistry(redis, unique_prefix)
    resolver = AdapterResolver(registry, ttl_s=60.0)
    assert await resolver.visible("acme") == []
    await registry.register("mine", "tiny", "/m", tenant="acme")
    await registry.register("pub", "tiny", "/p")
    # A named adapter missing from the snapshot is looked up again before it is refused.
    assert await resolver.resolve("tiny", tenant="acme", adapter="mine") == Resolved("tiny", "mine")
    assert [a.name for a in await resolver.visible("acme")] == ["mine", "pub"]
    assert [a.name for a in await resolver.visible("other")] == ["pub"]
    with pytest.raises(UnknownAdapterError):
        await resolver.resolve("tiny", tenant="other", adapter="mine")


async def test_resolver_serves_its_last_snapshot_while_redis_is_away(redis_url: str, unique_prefix: str) -> None:
    client = create_redis(url=redis_url)
    try:
        registry = LoRARegistry(client, unique_prefix)
        await registry.register("sql", "tiny", "/a")
        now = [0.0]
        resolver = AdapterResolver(registry, ttl_s=1.0, clock=lambda: now[0])
        assert (await resolver.resolve("sql", tenant="t")).adapter == "sql"
        # Redis gone: a client pointed at a closed port stands in for the outage.
        resolver.registry = LoRARegistry(create_redis(url="redis://127.0.0.1:1/0", retries=0), unique_prefix)
        now[0] = 2.0
        assert (await resolver.resolve("sql", tenant="t")).adapter == "sql"
        cold = AdapterResolver(resolver.registry)
        with pytest.raises((RedisError, OSError)):
            await cold.resolve("sql", tenant="t")
        await resolver.registry.redis.aclose()
    finally:
        await delete_prefixed_keys(client, unique_prefix)
        await client.aclose()


async def test_usage_rollup_groups_by_adapter(redis: Redis, unique_prefix: str) -> None:
    names = Names(unique_prefix)
    aggregates = UsageAggregates(redis, names, dedup_ttl_s=600, retention_days=2)
    usage = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)

    def record(rid: str, adapter: str | None) -> UsageRecord:
        request = InferenceRequest(request_id=rid, model="tiny", prompt="x", tenant="acme", adapter=adapter)
        return usage_record(request, producer="w1", usage=usage, finish_reason="stop")

    ledger = [record("r1", "sql"), record("r2", "sql"), record("r3", None), record("r1", "sql")]  # r1 twice
    assert await aggregates.apply(ledger) == 3
    now = int(time.time())
    by_adapter = await usage_report(redis, names, "acme", start=now - 3600, end=now + 3600, group_by="adapter")
    assert {row.adapter: row.total_tokens for row in by_adapter.data} == {"sql": 14, None: 7}
    assert by_adapter.totals.requests == 3
    by_model = await usage_report(redis, names, "acme", start=now - 3600, end=now + 3600, group_by="model")
    assert {row.model: row.requests for row in by_model.data} == {"tiny": 3}
