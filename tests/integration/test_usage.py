"""The usage ledger and token quotas on real Kafka and Redis: the rollup counts a request once however often its
record arrives (and a rollup that re-reads the ledger changes nothing) and settles its quota reservation; a key's
daily quota stops it at the exact token, through the official ``openai`` SDK, with a real GPU worker (in process,
a tiny random model) writing the ledger; Kafka-native records over their tenant's quota become dead letters; batch
lines over their key's quota become error lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from batch_support import ResultsWorker, batch_worker, chat_line, jsonl, wait_status
from ingress_support import KEY, MODEL, _fake_tokenizer, consume, eventually, heartbeat, reader, running_ingress
from openai import AsyncOpenAI
from redis.asyncio import Redis

from gpu_workers.worker.heartbeat import model_tokenizer
from gpu_workers.worker.main import run_worker
from router.stream import run_router
from schemas import (
    BatchOutputLine,
    ChatMessage,
    DeadLetter,
    InferenceRequest,
    ModelTokenizer,
    Names,
    SamplingOptions,
    Usage,
    WorkerHeartbeat,
)
from sluicegate.api.limits import estimate_request_tokens
from sluicegate.api.prompt_tokens import ModelTokenizerView
from sluicegate.kafka import create_consumer, create_producer, ensure_topics
from sluicegate.settings import Settings
from sluicegate.usage.ledger import usage_record
from sluicegate.usage.quota import QuotaClaim, QuotaLimit, Quotas
from sluicegate.usage.report import usage_report
from sluicegate.usage.rollup import UsageAggregates, UsageRollup, keep_rolling_up

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

OTHER_KEY = "sk-same-tenant-no-key-quota"


@pytest.fixture(autouse=True)
def _clear_of_midnight() -> None:
    """Quotas and the rollup count per UTC day and month: a test that crossed midnight UTC would see its counts
    start again half-way. One that would start in the last two minutes of a day waits for the next day instead."""
    now = datetime.now(UTC)
    left_s = 86_400 - (now.hour * 3600 + now.minute * 60 + now.second + now.microsecond / 1e6)
    if left_s < 120:
        time.sleep(left_s + 1)


@pytest.fixture
def settings(test_settings: Settings, tmp_path: Path) -> Settings:
    return test_settings.model_copy(
        update={
            "stream_token_secret": "integration-secret",
            "topic_partitions": 1,
            "heartbeat_interval_s": 0.3,
            "router_metrics_port": 0,
            "worker_metrics_port": 0,
            "state_dir": tmp_path / "state",
        }
    )


def keys_file(tmp_path: Path, *entries: dict[str, Any]) -> Path:
    path = tmp_path / "keys.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    return path


@contextlib.asynccontextmanager
async def rolling_up(settings: Settings, redis: Redis) -> AsyncIterator[None]:
    """The usage rollup, as the router process runs it."""
    stop = asyncio.Event()
    task = asyncio.create_task(keep_rolling_up(settings, redis, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def report(redis: Redis, settings: Settings, tenant: str, group_by: Any = None) -> Any:
    now = int(time.time())
    return await usage_report(
        redis, Names(settings.topic_prefix), tenant, start=now - 3600, end=now + 3600, group_by=group_by
    )


# --- the rollup: once per request id, and quota settlement -------------------------------------------------------


async def test_rollup_counts_each_request_once_and_settles_its_reservation(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    names = Names(settings.topic_prefix)
    quotas = Quotas(redis, names)
    month = QuotaLimit("tenant", "acme", "month", 1000)
    for rid, cost in (("r1", 100), ("r2", 100), ("r3", 50)):
        assert await quotas.reserve(QuotaClaim(rid, cost, (month,))) is None
    assert await quotas.used(month) == 250

    def request(rid: str, model: str, key_id: str | None) -> InferenceRequest:
        return InferenceRequest(request_id=rid, model=model, prompt="x", tenant="acme", key_id=key_id)

    def usage(prompt: int, output: int, **extra: Any) -> Usage:
        return Usage(prompt_tokens=prompt, completion_tokens=output, total_tokens=prompt + output, **extra)

    finished = usage_record(request("r1", "a", "k1"), producer="w1", usage=usage(10, 20), finish_reason="stop")
    cancelled = usage_record(request("r2", "b", "k2"), producer="w2", usage=usage(10, 5), finish_reason="abort")
    failed = usage_record(request("r3", "a", None), producer="w1", usage=None, finish_reason=None, error_code="x")
    hit = usage_record(
        request("r4", "a", "k1"), producer="response-cache", usage=usage(8, 8, cached=True), finish_reason="stop"
    )
    # Duplicates, as a worker that takes over a request sends its record again.
    ledger = [finished, cancelled, finished, failed, hit, cancelled]
    await ensure_topics(settings.kafka_bootstrap, {names.usage_topic: 1}, 1)
    producer = create_producer(settings)
    await producer.start()
    try:
        for record in ledger:
            await producer.send_and_wait(names.usage_topic, record.model_dump_json().encode(), key=b"r")
    finally:
        await producer.stop()

    async with rolling_up(settings, redis):
        await eventually(lambda: _counted(redis, settings, "acme", 4), timeout_s=60)
    by_model = await report(redis, settings, "acme", "model")
    totals = by_model.totals
    assert (totals.requests, totals.prompt_tokens, totals.output_tokens, totals.total_tokens) == (4, 28, 33, 61)
    assert (totals.finished, totals.cancelled, totals.failed, totals.response_cache) == (2, 1, 1, 1)
    assert {row.model: row.total_tokens for row in by_model.data} == {"a": 46, "b": 15}
    by_key = await report(redis, settings, "acme", "key")
    assert {row.key_id: row.requests for row in by_key.data} == {"k1": 2, "k2": 1, None: 1}
    # Each reservation settled to its record's tokens, once (r4 was a cache hit reserved by nobody here).
    assert await quotas.used(month) == 30 + 15 + 0

    # A rollup that died before committing reads the ledger again (here: a new group from the start): no change.
    consumer = create_consumer(names.usage_topic, group_id=f"{names.prefix}again", settings=settings)
    aggregates = UsageAggregates(redis, names, dedup_ttl_s=600, retention_days=1)
    again = UsageRollup(consumer, aggregates)
    await consumer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(again.run(stop))
    try:
        await eventually(lambda: _true(again.duplicates == len(ledger)), timeout_s=60)
    finally:
        stop.set()
        await task
        await consumer.stop()
    assert again.counted == 0
    assert (await report(redis, settings, "acme", "model")).totals == totals
    assert await quotas.used(month) == 45

    # A request that will not run (its publish failed) gives its tokens back; admitted again, it is charged again.
    assert await quotas.reserve(QuotaClaim("r5", 60, (month,))) is None
    assert await quotas.release("r5") and await quotas.used(month) == 45
    assert not await quotas.release("r5")
    assert await quotas.reserve(QuotaClaim("r5", 60, (month,))) is None and await quotas.used(month) == 105


async def _true(value: bool) -> bool:
    return value


async def _counted(redis: Redis, settings: Settings, tenant: str, requests: int) -> bool:
    return (await report(redis, settings, tenant)).totals.requests >= requests


# --- a key stopped at the exact token ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("usage-model") / MODEL, num_layers=2, hidden_size=64)


@contextlib.asynccontextmanager
async def serving(settings: Settings, redis: Redis) -> AsyncIterator[None]:
    """A real GPU worker (in process, engine in a thread) for ``settings.model``, once it owns its partitions."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, stop))
    names = Names(settings.topic_prefix)

    async def owns_partitions() -> bool:
        assert not task.done(), task.exception()
        beats = await redis.hgetall(names.workers_key(MODEL))
        return any(WorkerHeartbeat.model_validate_json(v).partitions for v in beats.values())

    try:
        await eventually(owns_partitions, timeout_s=90)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_a_key_quota_stops_it_at_the_exact_token(
    settings: Settings, redis: Redis, model_dir: Path, tmp_path: Path, cleanup_topics: None
) -> None:
    quota = 22
    settings = settings.model_copy(
        update={
            "api_keys_file": keys_file(
                tmp_path,
                {"key": KEY, "tenant": "acme", "tokens_per_day": quota},
                {"key": OTHER_KEY, "tenant": "acme"},
            ),
            "model": str(model_dir),
            "model_name": MODEL,
            "worker_id": "w-usage",
            "engine_mode": "thread",
            "kv_cache_gb": 0.05,
            "drain_timeout_s": 5.0,
        }
    )
    async with serving(settings, redis), rolling_up(settings, redis), running_ingress(settings) as url:
        api = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        other = AsyncOpenAI(base_url=f"{url}/v1", api_key=OTHER_KEY, max_retries=0)

        async def complete(client: AsyncOpenAI, prompt: list[int], max_tokens: int) -> Any:
            # Token ids and ignore_eos: the prompt's tokens and the output's are exactly known in advance.
            return await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
            )

        used = 0
        for _ in range(2):
            done = await complete(api, [5, 6, 7], 5)
            assert done.usage is not None and done.usage.total_tokens == 8
            used += done.usage.total_tokens
        assert quota - used == 6
        with pytest.raises(openai.RateLimitError) as over:
            await complete(api, [5, 6, 7], 4)  # 7 tokens, one more than the 6 left
        error = over.value
        assert error.code == "insufficient_quota" and error.type == "insufficient_quota"
        reset = datetime.fromisoformat(error.response.headers["x-quota-reset"])
        assert reset.tzinfo is not None and reset.astimezone(UTC).time().isoformat() == "00:00:00"
        assert 0 < int(error.response.headers["retry-after"]) <= 86400
        assert "has 6 left" in error.message and reset.strftime("%Y-%m-%dT%H:%M:%SZ") in error.message
        last = await complete(api, [5, 6, 7], 3)  # exactly the 6 left
        assert last.usage is not None and used + last.usage.total_tokens == quota
        with pytest.raises(openai.RateLimitError, match="has 0 left"):
            await complete(api, [5], 1)
        # The same tenant's other key has no key quota (and the tenant none): it is still served.
        assert (await complete(other, [5, 6, 7], 2)).usage.total_tokens == 5  # type: ignore[union-attr]

        # The ledger, rolled up: the key's 22 tokens in 3 requests, the other key's 5; refused requests are not
        # there. GET /v1/usage answers for the caller's own tenant.
        async def rolled_up() -> bool:
            return (await report(redis, settings, "acme")).totals.requests == 4

        await eventually(rolled_up, timeout_s=60)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {OTHER_KEY}"}) as http:
            answer = await http.get("/v1/usage", params={"group_by": "key"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["tenant"] == "acme" and body["totals"]["total_tokens"] == quota + 5
        assert sorted((row["requests"], row["total_tokens"]) for row in body["data"]) == [(1, 5), (3, quota)]
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {OTHER_KEY}"}) as http:
            # An end alone: that end's month up to it (an end before this month was refused, naming the start).
            last_year = await http.get("/v1/usage", params={"end": int(time.time()) - 400 * 86400})
            backwards = await http.get("/v1/usage", params={"start": 2000, "end": 1000})
        assert last_year.status_code == 200 and last_year.json()["totals"]["requests"] == 0, last_year.text
        assert backwards.status_code == 400 and backwards.json()["error"]["param"] == "end", backwards.text
        await api.close()
        await other.close()
    key_day = QuotaLimit("key", _key_id(KEY), "day", quota)
    assert await Quotas(redis, Names(settings.topic_prefix)).used(key_day) == quota


def _key_id(key: str) -> str:
    from ingress.auth import hash_key

    return hash_key(key)[:16]


# --- Kafka-native records and batch lines over quota -------------------------------------------------------------


async def test_kafka_native_records_over_their_tenants_quota_become_dead_letters(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    settings = settings.model_copy(
        update={"served_models": MODEL, "tenant_quotas": {"acme": {"tokens_per_day": 100}}, "usage_rollup": False}
    )
    names = Names(settings.topic_prefix)

    def record(rid: str, tenant: str = "acme") -> bytes:
        # 4 prompt token ids + 46 = 50 tokens reserved.
        sampling = SamplingOptions(max_tokens=46)
        request = InferenceRequest(request_id=rid, model=MODEL, prompt=[1, 2, 3, 4], sampling=sampling, tenant=tenant)
        return request.model_dump_json().encode()

    await ensure_topics(settings.kafka_bootstrap, {names.inbound_topic: 1}, 1)
    stop = asyncio.Event()
    task = asyncio.create_task(run_router(settings, stop=stop))
    producer = create_producer(settings)
    await producer.start()
    try:
        # One partition key: routed in this order. The fourth is the first again (a record re-read after a crash).
        for value in (record("n1"), record("n2"), record("n3"), record("n1"), record("x1", "other")):
            await producer.send_and_wait(names.inbound_topic, value, key=b"acme")
        async with (
            reader(settings, names.request_topic(MODEL, "standard"), partitions=1) as routed_reader,
            reader(settings, names.dlq_topic, partitions=1) as dlq_reader,
        ):
            routed = await consume(routed_reader, 4, timeout_s=60)
            (letter,) = await consume(dlq_reader, 1, timeout_s=30)
    finally:
        await producer.stop()
        stop.set()
        await asyncio.wait_for(task, 30)
    assert [InferenceRequest.model_validate_json(r.value).request_id for r in routed] == ["n1", "n2", "n1", "x1"]
    assert dict(letter.headers)["reason"] == b"insufficient_quota"
    dead = DeadLetter.model_validate_json(letter.value)
    assert dead.request_id == "n3" and "resets at" in dead.detail
    assert "daily token quota of tenant 'acme' (100 tokens per UTC day) has 0 left" in dead.detail
    used = await Quotas(redis, names).used(QuotaLimit("tenant", "acme", "day", 100))
    assert used == 100  # n1 was charged once


async def test_batch_lines_over_their_keys_quota_become_error_lines(
    settings: Settings, redis: Redis, tmp_path: Path, cleanup_topics: None
) -> None:
    # Each line reserves its prompt as the fake worker's published tokenizer counts it and max_tokens 50; two fit.
    quota = 2 * (_exact_prompt_tokens("hello 0") + 50)
    lines = [chat_line(f"q{n}", f"hello {n}") for n in range(4)]
    done, errors = await _batch_under_quota(settings, redis, tmp_path, quota, lines, chunk_size=2)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert [line.custom_id for line in errors] == ["q2", "q3"]
    for line in errors:
        assert line.response is not None and line.response.status_code == 429
        error = line.response.body["error"]
        assert error["code"] == error["type"] == "insufficient_quota" and "resets at" in error["message"]
    assert (
        await Quotas(redis, Names(settings.topic_prefix)).used(QuotaLimit("key", _key_id(KEY), "day", quota)) == quota
    )


async def _batch_under_quota(
    settings: Settings, redis: Redis, tmp_path: Path, quota: int, lines: list[dict[str, Any]], *, chunk_size: int
) -> tuple[Any, list[BatchOutputLine]]:
    """Run ``lines`` as a chat batch of a key with a daily token quota of ``quota``, served by the fake worker
    (which publishes the model's tokenizer, as a worker does at start): the ended batch and its error lines."""
    settings = settings.model_copy(
        update={
            "api_keys_file": keys_file(tmp_path, {"key": KEY, "tenant": "acme", "tokens_per_day": quota}),
            "heartbeat_interval_s": 60.0,
            "files_url": str(tmp_path / "files"),
            "batch_tick_s": 0.3,
            "batch_chunk_size": chunk_size,
            "batch_stall_check_s": 1.0,
        }
    )
    await heartbeat(redis, Names(settings.topic_prefix))
    async with running_ingress(settings) as url, AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as api:
        async with ResultsWorker(settings, redis):
            with batch_worker(settings, tmp_path / "batch-worker.log"):
                uploaded = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
                batch = await api.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                done = await wait_status(api, batch.id, {"completed", "failed"}, timeout_s=120)
        if done.error_file_id is None:
            return done, []
        text = (await api.files.content(done.error_file_id)).text
    return done, [BatchOutputLine.model_validate_json(line) for line in text.splitlines()]


def _exact_prompt_tokens(text: str) -> int:
    """A one-message chat prompt's tokens as the fake worker's published tokenizer and chat template count them."""
    published = model_tokenizer(MODEL, _fake_tokenizer(), max_model_len=None)
    assert published is not None
    view = ModelTokenizerView(ModelTokenizer.model_validate_json(published))
    return len(view.encode_messages([ChatMessage(role="user", content=text)], None))


async def test_a_batch_line_reserves_its_prompt_as_the_worker_counts_it(
    settings: Settings, redis: Redis, tmp_path: Path, cleanup_topics: None
) -> None:
    """With the model's tokenizer published, a chat line reserves its prompt through the chat template (19 tokens
    for "hello N" here, the estimate says 6): a key's quota of two lines' worth admits two lines, not all four (the
    estimate ran a key past its quota)."""
    names = Names(settings.topic_prefix)
    hello = [ChatMessage(role="user", content="hello 0")]
    probe = InferenceRequest(request_id="probe", model=MODEL, messages=hello, sampling={"max_tokens": 1})
    exact = _exact_prompt_tokens("hello 0") + 1
    assert 4 * (estimate_request_tokens(probe) + 1) <= 2 * exact, "the estimate would admit every line"
    lines = [chat_line(f"q{n}", f"hello {n}", max_tokens=1) for n in range(4)]
    done, _ = await _batch_under_quota(settings, redis, tmp_path, 2 * exact, lines, chunk_size=4)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert await Quotas(redis, names).used(QuotaLimit("key", _key_id(KEY), "day", 2 * exact)) == 2 * exact
