"""Ingress admission on a real Kafka broker and Redis server: the per-model backlog bound (read from the worker
group's consumer lag and the workers' heartbeats), per-key rate limits kept in Redis, per-key size limits and
queue budgets, and tenant isolation through the real result service.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiokafka import TopicPartition
from ingress_support import (
    KEY,
    MODEL,
    FakeWorker,
    consume,
    heartbeat,
    reader,
    running_app,
    running_ingress,
)
from redis.asyncio import Redis

from ingress.auth import hash_key
from ingress.ratelimit import RateLimiter
from result_service.app import create_app as create_result_app
from schemas import InferenceRequest, Names, utcnow
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import Limits
from sluicegate.kafka import create_consumer
from sluicegate.settings import Settings
from sluicegate.usage.quota import QuotaLimit, Quotas

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RPM_KEY = "sk-three-per-minute"
RPS_KEY = "sk-one-per-second"
TPM_KEY = "sk-thousand-tokens-per-minute"
SMALL_KEY = "sk-small-requests-only"
OTHER_TENANT_KEY = "sk-other-tenant-key"
CHARGED_KEY = "sk-three-per-minute-and-a-daily-quota"
SECRET = "admission-secret"


@pytest.fixture
def settings(test_settings: Settings, tmp_path: Path) -> Settings:
    keys = tmp_path / "keys.jsonl"
    entries: list[dict[str, Any]] = [
        {"key_hash": hash_key(RPM_KEY), "tenant": "rpm", "rpm": 3},
        {"key": RPS_KEY, "tenant": "rps", "rps": 1},
        {"key": TPM_KEY, "tenant": "tpm", "tpm": 1000},
        {
            "key": SMALL_KEY,
            "tenant": "small",
            "max_prompt_tokens": 10,
            "max_tokens": 50,
            "max_body_bytes": 2048,
            "default_queue_budget_s": 30,
        },
        {"key": OTHER_TENANT_KEY, "tenant": "other"},
        {"key": CHARGED_KEY, "tenant": "charged", "rpm": 3, "tokens_per_day": 10_000},
    ]
    keys.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    return test_settings.model_copy(
        update={
            "api_keys": KEY,
            "api_keys_file": keys,
            "stream_token_secret": SECRET,
            "topic_partitions": 3,
            "heartbeat_interval_s": 1.0,
            "kafka_timeout_s": 5.0,
            "request_timeout_s": 20.0,
            "served_models": MODEL,
        }
    )


def client(url: str, key: str = KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


async def published(settings: Settings, count: int) -> list[InferenceRequest]:
    """Every request on the model's request topics (all tiers), read from the beginning."""
    names = Names(settings.topic_prefix)
    async with reader(settings, *names.request_topics(MODEL), partitions=settings.topic_partitions) as consumer:
        records = await consume(consumer, count)
        # Anything beyond ``count`` would be a duplicate or a request that should not be there.
        records += [r for batch in (await consumer.getmany(timeout_ms=500)).values() for r in batch]
    return [InferenceRequest.model_validate_json(r.value) for r in records]


async def until_status(
    http: httpx.AsyncClient, body: dict[str, Any], status: int, accepted: list[str], timeout_s: float = 10
) -> None:
    """Submit ``body`` until it answers ``status``, adding the id of every accepted request to ``accepted``."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await http.post("/v1/requests", json=body)
        assert response.status_code in (202, 429), response.text
        if response.status_code == 202:
            accepted.append(response.json()["request_id"])
        if response.status_code == status:
            return
        assert time.monotonic() < deadline, f"still {response.status_code} after {timeout_s}s: {response.text}"
        await asyncio.sleep(0.1)


# --- backlog bound -----------------------------------------------------------------------------------------------
async def test_backlog_bound_answers_429_and_readmits_as_workers_progress(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    bounded = settings.model_copy(update={"max_backlog_per_model": 5, "backlog_cache_s": 0.2})
    names = Names(settings.topic_prefix)
    body = {"model": MODEL, "prompt": "queue me", "max_tokens": 4}
    accepted: list[str] = []
    async with running_ingress(bounded) as url, client(url) as http:
        # No worker runs: every accepted request stays in Kafka.
        for _ in range(12):
            response = await http.post("/v1/requests", json=body)
            if response.status_code != 202:
                break
            accepted.append(response.json()["request_id"])
        assert len(accepted) == 5, response.text
        assert response.status_code == 429
        assert response.headers["retry-after"] == str(bounded.backlog_retry_after_s)
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "model_backlog_full", None)
        assert "5 requests waiting" in error["message"]
        # OpenAI clients see their usual exception.
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await sdk.completions.create(model=MODEL, prompt="too many")
        await sdk.close()
        # The bound counts what is ahead: nothing waits at the interactive tier, so it is admitted; batch is not.
        interactive = await http.post("/v1/requests", json=body | {"priority": "interactive"})
        assert interactive.status_code == 202, interactive.text
        accepted.append(interactive.json()["request_id"])
        assert (await http.post("/v1/requests", json=body | {"priority": "batch"})).status_code == 429

        # A worker picks all six up but commits nothing yet: the lag still counts them, the heartbeat says they
        # run, so nothing is waiting and new requests are admitted again.
        group = create_consumer(group_id=names.worker_group(MODEL), settings=settings)
        await group.start()
        try:
            group.assign([TopicPartition(t, p) for t in names.request_topics(MODEL) for p in range(3)])
            taken = await consume(group, 6)
            await heartbeat(redis, names, running=6)
            await until_status(http, body, 202, accepted)
            # They finished (heartbeat: nothing running) but their offsets are not committed: the lag is back.
            await heartbeat(redis, names, running=0)
            await until_status(http, body, 429, accepted)
            # Committing the finished offsets clears the backlog down to what was accepted since.
            await group.commit({TopicPartition(r.topic, r.partition): r.offset + 1 for r in taken})
            await until_status(http, body, 202, accepted)
        finally:
            await group.stop()

    # Nothing accepted was dropped, nothing refused was queued, nothing was published twice.
    requests = await published(settings, len(accepted))
    assert sorted(r.request_id for r in requests) == sorted(accepted)


async def test_a_request_the_backlog_refuses_costs_its_key_nothing(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    # Admission charges a key (its rate limits, then its token quota) only once the queue has room: a request
    # the backlog bound turns away leaves no rate-limit counter and no quota reservation behind.
    bounded = settings.model_copy(update={"max_backlog_per_model": 1})
    names = Names(settings.topic_prefix)
    key_id = hash_key(CHARGED_KEY)[:16]
    day = QuotaLimit("key", key_id, "day", 10_000)
    quotas = Quotas(redis, names)
    body = {"model": MODEL, "prompt": "queue me", "max_tokens": 4}
    async with running_ingress(bounded) as url, client(url) as free, client(url, CHARGED_KEY) as charged:
        # No worker runs: one request fills the backlog.
        assert (await free.post("/v1/requests", json=body)).status_code == 202
        refused = await charged.post("/v1/requests", json=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "model_backlog_full", refused.text
        assert "x-ratelimit-remaining-requests" not in refused.headers
    assert not await redis.exists(names.rate_key(key_id, "rpm"))
    assert not await redis.exists(names.quota_hold_key(refused.headers["x-request-id"]))
    assert await quotas.used(day) == 0
    # The same key through an ingress with room is charged for one request: the refused one cost nothing.
    async with running_ingress(settings) as url, client(url, CHARGED_KEY) as charged:
        admitted = await charged.post("/v1/requests", json=body)
    assert admitted.status_code == 202, admitted.text
    assert admitted.headers["x-ratelimit-remaining-requests"] == "2"
    assert await redis.exists(names.quota_hold_key(admitted.json()["request_id"]))
    assert 0 < await quotas.used(day) < 100


# --- rate limits -------------------------------------------------------------------------------------------------
async def test_rate_limits_are_per_key_shared_by_replicas_and_answer_429_with_retry_after(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    names = Names(settings.topic_prefix)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    # Two ingress replicas: the limits live in Redis, so they share one budget.
    async with running_ingress(settings) as first, running_ingress(settings) as second:
        async with client(first, RPM_KEY) as a, client(second, RPM_KEY) as b, client(first) as free:
            sent = time.monotonic()
            answers = [await http.post("/v1/requests", json=body) for http in (a, b, a)]
            elapsed = time.monotonic() - sent
            assert [r.status_code for r in answers] == [202, 202, 202]
            # What is left, as OpenAI's headers say it, counted down across both replicas; each request adds 20 s
            # to the time until the key's minute is whole again (less the time since the first one).
            assert [r.headers["x-ratelimit-limit-requests"] for r in answers] == ["3", "3", "3"]
            assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
            resets = [float(r.headers["x-ratelimit-reset-requests"].removesuffix("s")) for r in answers]
            for n, reset in enumerate(resets, start=1):
                assert 20 * n - elapsed - 0.5 <= reset <= 20 * n, resets
            assert "x-ratelimit-limit-tokens" not in answers[0].headers  # this key has no token limit
            refused = await b.post("/v1/requests", json=body)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert "3 requests per minute" in refused.json()["error"]["message"]
            # GCRA at 3/min: the next slot opens 20 s after the first request.
            assert 15 <= int(refused.headers["retry-after"]) <= 20
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            # Another key is not affected, and one without limits gets no rate headers.
            unlimited = await free.post("/v1/requests", json=body)
            assert unlimited.status_code == 202 and "x-ratelimit-remaining-requests" not in unlimited.headers
        async with client(first, RPS_KEY) as a, client(second, RPS_KEY) as b:
            assert (await a.post("/v1/requests", json=body)).status_code == 202
            refused = await b.post("/v1/requests", json=body)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            await asyncio.sleep(1.0)
            assert (await b.post("/v1/requests", json=body)).status_code == 202
        key_id = hash_key(RPM_KEY)[:16]
        assert await redis.exists(names.rate_key(key_id, "rpm"))
        assert 0 < await redis.pttl(names.rate_key(key_id, "rpm")) <= 60_000

        async with client(first, TPM_KEY) as http:
            # Tokens = prompt estimate (5 bytes -> 2) + max_tokens.
            charged = await http.post("/v1/requests", json=body | {"max_tokens": 600})
            assert charged.status_code == 202
            assert charged.headers["x-ratelimit-limit-tokens"] == "1000"
            assert charged.headers["x-ratelimit-remaining-tokens"] == "398"
            assert charged.headers["x-ratelimit-reset-tokens"].endswith("s")
            assert "x-ratelimit-limit-requests" not in charged.headers  # no request limit on this key
            refused = await http.post("/v1/requests", json=body | {"max_tokens": 600})
            assert refused.status_code == 429 and "1000 tokens per minute" in refused.json()["error"]["message"]
            assert int(refused.headers["retry-after"]) >= 1
            assert 398 <= int(refused.headers["x-ratelimit-remaining-tokens"]) < 600  # refused: nothing charged
            # A smaller request still fits in what is left of the minute.
            assert (await http.post("/v1/requests", json=body | {"max_tokens": 300})).status_code == 202
            # One request that alone exceeds the budget could never pass: 400, not a 429 to retry forever.
            too_big = await http.post("/v1/requests", json=body | {"max_tokens": 5000})
            assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "rate_limit_cost_exceeded"
    assert len(await published(settings, 8)) == 8


async def test_a_limit_below_one_per_period_lets_one_request_through_each_interval(
    settings: Settings, redis: Redis
) -> None:
    # 0.5 requests a second is one every 2 s: a bucket of one period held less than one request, and every
    # request was refused forever.
    limiter = RateLimiter(redis, Names(settings.topic_prefix))
    half = Limits(rps=0.5)
    first = await limiter.acquire("half-rps", half, tokens=1)
    assert first is not None and first.headers()["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(ApiError) as refused:
        await limiter.acquire("half-rps", half, tokens=1)
    assert refused.value.status == 429 and refused.value.headers is not None
    assert refused.value.headers["Retry-After"] == "2"
    await redis.delete(Names(settings.topic_prefix).rate_key("half-rps", "rps"))  # as if 2 s had passed
    assert await limiter.acquire("half-rps", half, tokens=1) is not None


# --- size limits and queue budget ------------------------------------------------------------------------------
async def test_per_key_size_limits_and_queue_budget(settings: Settings, redis: Redis, cleanup_topics: None) -> None:
    async with running_ingress(settings) as url, client(url, SMALL_KEY) as small, client(url) as default:
        too_long = await small.post("/v1/requests", json={"model": MODEL, "prompt": "x" * 100})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert (error["code"], error["param"]) == ("prompt_too_long", "prompt")
        assert "25 estimated tokens" in error["message"] and "limit of 10" in error["message"]
        ids = await small.post("/v1/requests", json={"model": MODEL, "prompt": list(range(11))})
        assert ids.status_code == 400 and "11 token ids" in ids.json()["error"]["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "y" * 40}]}
        assert (await small.post("/v1/chat/completions", json=chat)).json()["error"]["param"] == "messages"

        asked = await small.post("/v1/requests", json={"model": MODEL, "prompt": "hi", "max_tokens": 51})
        assert asked.status_code == 400
        assert (asked.json()["error"]["code"], asked.json()["error"]["param"]) == ("max_tokens_exceeded", "max_tokens")

        big = {"model": MODEL, "prompt": "z" * 3000}
        oversized = await small.post("/v1/requests", json=big)
        assert oversized.status_code == 413 and "2048 bytes" in oversized.json()["error"]["message"]
        # The same body is fine for a key with the default (1 MB) limit.
        assert (await default.post("/v1/requests", json=big)).status_code == 202

        # No max_tokens given: the default (256) is lowered to the key's cap instead of refused.
        before = utcnow()
        capped = await small.post("/v1/requests", json={"model": MODEL, "prompt": "hi"})
        assert capped.status_code == 202, capped.text
        explicit_deadline = (utcnow() + timedelta(seconds=300)).isoformat()
        own = await small.post("/v1/requests", json={"model": MODEL, "prompt": "hi", "deadline": explicit_deadline})
        assert own.status_code == 202
    by_id = {r.request_id: r for r in await published(settings, 3)}
    budgeted = by_id[capped.json()["request_id"]]
    assert budgeted.sampling.max_tokens == 50
    # The key's 30 s queue budget became the deadline; a request's own deadline wins over it.
    assert budgeted.deadline is not None
    assert timedelta(seconds=29) <= budgeted.deadline - before <= timedelta(seconds=32)
    kept = by_id[own.json()["request_id"]]
    assert kept.deadline is not None and kept.deadline.isoformat() == explicit_deadline
    assert by_id[capped.json()["request_id"]].tenant == "small"


# --- tenancy ----------------------------------------------------------------------------------------------------
async def test_a_tenant_sees_only_its_own_requests_and_streams(
    settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names)
    async with (
        FakeWorker(settings, redis),
        running_ingress(settings) as url,
        running_app(create_result_app(settings)) as results,
        client(url) as mine,
        client(url, OTHER_TENANT_KEY) as theirs,
        httpx.AsyncClient(base_url=results, timeout=30) as relay,
    ):
        submitted_mine = (await mine.post("/v1/requests", json={"model": MODEL, "prompt": "mine"})).json()
        submitted_theirs = (await theirs.post("/v1/requests", json={"model": MODEL, "prompt": "theirs"})).json()
        rid, other_rid = submitted_mine["request_id"], submitted_theirs["request_id"]

        # Status and cancel of another tenant's request look exactly like a missing request.
        for method in ("GET", "DELETE"):
            response = await theirs.request(method, f"/v1/requests/{rid}")
            assert response.status_code == 404 and response.json()["error"]["code"] == "request_not_found"
        assert (await mine.get(f"/v1/requests/{rid}")).status_code == 200

        # A stream token opens its own request's stream and no other.
        token, other_token = submitted_mine["stream_token"], submitted_theirs["stream_token"]
        own = await relay.get(f"/v1/streams/{rid}/sse", params={"token": token})
        assert own.status_code == 200 and '"type":"done"' in own.text.replace(" ", "")
        # Swapping the tenant part of a token (keeping the MAC) does not transfer it either.
        forged = f"other.{token.rpartition('.')[2]}"
        for request_id, wrong in ((other_rid, token), (rid, other_token), (rid, forged)):
            denied = await relay.get(f"/v1/streams/{request_id}/sse", params={"token": wrong})
            assert denied.status_code == 401, (request_id, wrong, denied.status_code)
