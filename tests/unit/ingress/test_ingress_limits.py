"""Per-key limits, the backlog arithmetic and the OpenAPI document, without a backbone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from ingress.app import create_app
from ingress.auth import hash_key, parse_keys_file
from ingress.backlog import backlog_ahead
from ingress.ratelimit import RateState, WindowState, go_duration
from sluicegate.api.bodies import ChatCompletionBody, CompletionBody, NativeRequestBody
from sluicegate.api.build import build_request
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import KeyLimits, Limits, check_prompt_tokens, check_rate_cost, checked_max_tokens
from sluicegate.settings import Settings

KEY = "sk-unit-limits-key"
USER = {"role": "user", "content": "q"}


def test_backlog_ahead_counts_tiers_at_or_above_and_takes_running_off_the_top() -> None:
    lags = {"interactive": 2, "standard": 5, "batch": 100}
    assert backlog_ahead(lags, 0, "interactive") == 2
    assert backlog_ahead(lags, 0, "standard") == 7
    assert backlog_ahead(lags, 0, "batch") == 107
    # Three running: the two interactive ones and one standard have started.
    assert backlog_ahead(lags, 3, "interactive") == 0
    assert backlog_ahead(lags, 3, "standard") == 4
    assert backlog_ahead(lags, 3, "batch") == 104
    # Stale heartbeats may report more running than the lag holds: never negative.
    assert backlog_ahead(lags, 1000, "batch") == 0
    assert backlog_ahead({}, 0, "batch") == 0


def test_prompt_estimates_and_limits() -> None:
    limits = Limits(max_prompt_tokens=10)
    assert check_prompt_tokens(CompletionBody(model="m", prompt="x" * 40), limits) == 10
    assert check_prompt_tokens(NativeRequestBody(model="m", prompt=list(range(10))), limits) == 10
    # Text is counted in UTF-8 bytes: 10 three-byte characters are 30 bytes, 8 tokens.
    assert check_prompt_tokens(NativeRequestBody(model="m", prompt="語" * 10), limits) == 8
    chat = ChatCompletionBody(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "abcd"}]}])
    assert check_prompt_tokens(chat, limits) == 4 + 1
    with pytest.raises(ApiError) as info:
        check_prompt_tokens(CompletionBody(model="m", prompt="x" * 41), limits)
    assert (info.value.status, info.value.code, info.value.param) == (400, "prompt_too_long", "prompt")
    with pytest.raises(ApiError) as info:
        check_prompt_tokens(NativeRequestBody(model="m", messages=[{"role": "user", "content": "y" * 40}]), limits)
    assert info.value.param == "messages"
    assert check_prompt_tokens(CompletionBody(model="m", prompt="x" * 10_000), Limits()) == 2500


def test_max_tokens_default_is_capped_but_an_explicit_excess_is_refused() -> None:
    limits = Limits(max_tokens=50)
    assert checked_max_tokens(NativeRequestBody(model="m", prompt="p"), limits) == 50
    assert checked_max_tokens(NativeRequestBody(model="m", prompt="p", max_tokens=20), limits) == 20
    assert checked_max_tokens(CompletionBody(model="m", prompt="p"), limits) == 16
    with pytest.raises(ApiError) as info:
        checked_max_tokens(
            ChatCompletionBody(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=51), limits
        )
    assert (info.value.status, info.value.code, info.value.param) == (400, "max_tokens_exceeded", "max_tokens")
    body = ChatCompletionBody(model="m", messages=[USER], max_completion_tokens=99)
    with pytest.raises(ApiError, match="'max_completion_tokens' is 99"):
        checked_max_tokens(body, limits)
    assert checked_max_tokens(NativeRequestBody(model="m", prompt="p", max_tokens=10**6), Limits()) == 10**6


def test_a_request_larger_than_the_per_minute_token_budget_is_a_400() -> None:
    check_rate_cost(1000, Limits(tpm=1000))
    check_rate_cost(10**9, Limits())
    with pytest.raises(ApiError) as info:
        check_rate_cost(1001, Limits(tpm=1000))
    assert (info.value.status, info.value.code) == (400, "rate_limit_cost_exceeded")


def test_key_limits_fall_back_to_settings_and_budget_becomes_deadline() -> None:
    settings = Settings(limit_rpm=60, limit_tpm=10_000, max_body_bytes=4096, default_queue_budget_s=5)
    resolved = KeyLimits(rpm=0, max_tokens=64).resolve(settings)
    assert (resolved.rpm, resolved.tpm, resolved.max_tokens, resolved.max_body_bytes) == (0, 10_000, 64, 4096)
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert resolved.default_deadline(now) == now + timedelta(seconds=5)
    assert Limits().default_deadline(now) is None

    body = CompletionBody(model="m", prompt="p")
    request = build_request(
        body, request_id="r1", tenant="t", tier="standard", trace=None, now=now, max_tokens=7, default_deadline=now
    )
    assert (request.sampling.max_tokens, request.deadline) == (7, now)
    native = NativeRequestBody(model="m", prompt="p", deadline=60)
    request = build_request(
        native, request_id="r2", tenant="t", tier="standard", trace=None, now=now, default_deadline=now
    )
    assert request.deadline == now + timedelta(seconds=60)


def test_keys_file_lines_carry_limits_and_reject_bad_ones() -> None:
    line = {"key_hash": hash_key("sk-limited-01"), "tenant": "acme", "rps": 0.5, "tpm": 9000, "max_body_bytes": 2048}
    (key,) = parse_keys_file([json.dumps(line)])
    assert key.limits == KeyLimits(rps=0.5, tpm=9000, max_body_bytes=2048)
    assert key.key_id == hash_key("sk-limited-01")[:16]
    for bad, problem in (({"rpm": -1}, "'rpm'"), ({"max_body_bytes": 10}, "'max_body_bytes'"), ({"rpn": 3}, "'rpn'")):
        with pytest.raises(ValueError, match=problem):
            parse_keys_file([json.dumps({"key": "sk-limited-02"} | bad)])


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        kafka_bootstrap="127.0.0.1:1",
        redis_url="redis://127.0.0.1:1/0",
        api_keys=KEY,
        stream_token_secret="unit-secret",
        kafka_timeout_s=1.0,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as http:
            yield http


async def test_unpaired_surrogates_are_a_400_not_a_crash(client: httpx.AsyncClient) -> None:
    raw = b'{"model": "m", "prompt": "a\\ud800b"}'
    response = await client.post("/v1/completions", content=raw, headers={"x-api-key": KEY})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    # A correctly paired escape (an emoji) is text like any other and reaches the backbone (here: absent).
    raw = b'{"model": "m", "prompt": "a\\ud83d\\ude00b"}'
    assert (await client.post("/v1/completions", content=raw, headers={"x-api-key": KEY})).status_code == 503


async def test_openapi_documents_bodies_errors_and_auth(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    submit = spec["paths"]["/v1/requests"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/NativeRequestBody")
    assert {"202", "400", "401", "413", "429", "503"} <= set(submit["responses"])
    assert "Retry-After" in submit["responses"]["429"]["headers"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(spec["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert "security" not in spec["paths"]["/healthz"]["get"]
    # Every $ref resolves inside the document.
    refs = {part.split('"')[0] for part in json.dumps(spec).split('"$ref": "#/components/schemas/')[1:]}
    assert refs <= set(schemas)


def test_backlog_counts_a_published_record_once_even_when_its_ack_arrives_after_a_refresh() -> None:
    from aiokafka import TopicPartition

    from ingress.backlog import BacklogMonitor, _Estimate
    from ingress.telemetry import IngressMetrics
    from schemas import Names

    names = Names("t.")
    monitor = BacklogMonitor(Settings(), names, IngressMetrics())
    topic = names.request_topic("m", "standard")
    # A refresh read end offset 3 on partition 0: offsets 0-2 are already in its lag of 3.
    monitor._estimates["m"] = _Estimate(0.0, {"standard": 3}, {TopicPartition(topic, 0): 3})
    monitor.accepted("m", "standard", topic, 0, 2)  # acknowledged late: already counted
    monitor.accepted("m", "standard", topic, 0, 3)  # published after the read: counts once
    monitor.accepted("m", "standard", topic, 1, 0)  # a partition the read did not cover
    assert monitor.estimate("m") == {"interactive": 0, "standard": 5, "batch": 0}


@pytest.mark.parametrize(
    ("ms", "written"),
    [
        (0, "0s"),
        (-5, "0s"),
        (20, "20ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (360_000, "6m0s"),
        (3_723_400, "1h2m3.4s"),
    ],
)
def test_rate_limit_resets_are_written_as_go_durations_as_openai_sends_them(ms: int, written: str) -> None:
    assert go_duration(ms) == written


def test_rate_headers_take_requests_from_the_minute_limit_and_tokens_from_the_token_limit() -> None:
    state = RateState(
        (WindowState("rps", 2, 1, 500), WindowState("rpm", 60, 59, 1000), WindowState("tpm", 1000, 900, 6000))
    )
    assert state.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "6s",
    }
    # Only a per-second limit: the request headers follow it.
    assert RateState((WindowState("rps", 0.5, 0, 2000),)).headers() == {
        "x-ratelimit-limit-requests": "0.5",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "2s",
    }


def test_parts_charged_concurrently_keep_the_least_any_left() -> None:
    older = RateState((WindowState("rpm", 60, 41, 19_000), WindowState("tpm", 1000, 500, 30_000)))
    newer = RateState((WindowState("rpm", 60, 40, 20_000), WindowState("tpm", 1000, 600, 24_000)))
    assert newer.tightest(older) == older.tightest(newer)
    assert newer.tightest(older).windows == (WindowState("rpm", 60, 40, 20_000), WindowState("tpm", 1000, 500, 30_000))
