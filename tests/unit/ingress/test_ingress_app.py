"""The ingress app's answers that need no backbone: authentication, body limits, validation errors in
OpenAI's shape, CORS, metrics, and refusing to start misconfigured. Kafka and Redis point at a closed
port, so anything that reaches them would fail with a 503 instead."""

from __future__ import annotations

import gzip
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from ingress.app import create_app
from sluicegate.browser_origins import browser_origins
from sluicegate.settings import Settings

KEY = "sk-unit-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}


def settings(**overrides: object) -> Settings:
    base: dict[str, object] = {
        "kafka_bootstrap": "127.0.0.1:1",
        "redis_url": "redis://127.0.0.1:1/0",
        "api_keys": KEY,
        "stream_token_secret": "unit-secret",
        "max_body_bytes": 4096,
        "kafka_timeout_s": 1.0,
        "result_port": 8123,
        "cors_origins": "https://chat.example.com",
    }
    return Settings(**(base | overrides))  # type: ignore[arg-type]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as http:
            http.app = app  # type: ignore[attr-defined]
            yield http


def assert_openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    # Every error carries a request id, a fresh one where no request was accepted, as OpenAI's do.
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    assert error["param"] == param


async def test_missing_or_wrong_key_is_401(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    assert_openai_error(
        await client.post("/v1/completions", json={}, headers={"x-api-key": "nope"}), 401, "invalid_api_key"
    )
    assert_openai_error(await client.get("/v1/models"), 401, "invalid_api_key")
    assert_openai_error(await client.get("/v1/requests/abc"), 401, "invalid_api_key")


async def test_oversized_bodies_are_413_by_length_or_by_stream(client: httpx.AsyncClient) -> None:
    big = b'{"model": "m", "prompt": "' + b"x" * 5000 + b'"}'
    assert_openai_error(await client.post("/v1/completions", content=big, headers=AUTH), 413, "request_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"x" * 1000

    # No Content-Length: the limit applies while the body streams in.
    response = await client.post("/v1/completions", content=chunks(), headers=AUTH)
    assert_openai_error(response, 413, "request_too_large")


async def test_validation_errors_are_400_naming_the_field(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT | {"temperature": 9}, headers=AUTH)
    assert_openai_error(response, 400, "invalid_value", "temperature")
    response = await client.post("/v1/chat/completions", json=CHAT | {"functions": [{"name": "f"}]}, headers=AUTH)
    assert_openai_error(response, 400, "unsupported_parameter", "functions")
    response = await client.post("/v1/requests", json={"model": "m", "prompt": "x", "priority": "gold"}, headers=AUTH)
    assert_openai_error(response, 400, "invalid_value", "priority")
    response = await client.post("/v1/completions", content=b"{oops", headers=AUTH)
    assert_openai_error(response, 400, "invalid_json")
    # Nested past Python's recursion limit: once a plain-text 500 and a dropped connection.
    deep = b'{"model": "m", "prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}"  # under the app's 4 KB body limit
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/requests", "/v1/embeddings", "/v1/responses"):
        response = await client.post(path, content=deep, headers=AUTH)
        assert_openai_error(response, 400, "invalid_json")
        assert "nested too deeply" in response.json()["error"]["message"], path
    # NaN and Infinity are not JSON: said so, not refused as out of range.
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"model": "m", "prompt": "x", "temperature": ' + constant + b"}"
        response = await client.post("/v1/completions", content=body, headers=AUTH)
        assert_openai_error(response, 400, "invalid_json")
        assert "is not a JSON value" in response.json()["error"]["message"]
    response = await client.post("/v1/completions", json=[1, 2], headers=AUTH)
    assert_openai_error(response, 400, "invalid_value")


async def test_unknown_routes_and_ids_answer_in_openai_shape(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/nothing-here"), 404, "not_found")
    assert_openai_error(await client.get("/v1/requests/bad$id", headers=AUTH), 404, "request_not_found", "request_id")


async def test_backbone_outage_is_a_quick_503(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert_openai_error(response, 503, "service_unavailable")
    assert "Redis" in response.json()["error"]["message"]


async def test_cors_allows_the_result_service_and_configured_origins(client: httpx.AsyncClient) -> None:
    for origin in ("http://127.0.0.1:8123", "http://localhost:8123", "https://chat.example.com"):
        response = await client.options(
            "/v1/requests",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
    refused = await client.options(
        "/v1/requests", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in refused.headers


async def test_a_browser_on_another_origin_can_read_retry_after_and_the_request_id(client: httpx.AsyncClient) -> None:
    """The chat page (the result service's origin) shows how long to wait after a 429: the header must be exposed."""
    response = await client.get("/v1/models", headers={"Origin": "http://127.0.0.1:8123"})
    exposed = {h.strip().lower() for h in response.headers["access-control-expose-headers"].split(",")}
    assert {"retry-after", "x-request-id", "x-request-ids", "x-should-retry", "x-quota-reset"} <= exposed


async def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_500(client: httpx.AsyncClient) -> None:
    """Headers and part of the body, then the connection drops: no error, no traceback, counted as 499."""
    app = client.app  # type: ignore[attr-defined]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/requests"):
        incoming = iter([{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}])
        sent: list[dict[str, object]] = []

        async def receive(incoming=incoming) -> dict[str, object]:  # type: ignore[no-untyped-def]
            return next(incoming, {"type": "http.disconnect"})

        async def send(message: dict[str, object], sent=sent) -> None:  # type: ignore[no-untyped-def]
            sent.append(message)

        headers = [(b"authorization", AUTH["Authorization"].encode()), (b"content-length", b"100")]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers,
            "server": ("ingress", 80),
            "client": ("127.0.0.1", 5000),
            "root_path": "",
        }
        await app(scope, receive, send)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, (path, sent)
    scraped = (await client.get("/metrics")).text
    assert 'status="500"' not in scraped


async def test_a_browser_may_send_the_apis_and_the_sdks_request_headers(client: httpx.AsyncClient) -> None:
    """X-Request-Deadline and Cache-Control are the API's own; the openai JS SDK adds x-stainless-* to every call."""
    asked = "authorization, content-type, x-request-deadline, cache-control, x-stainless-os, openai-beta"
    response = await client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://127.0.0.1:8123",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
    )
    assert response.status_code == 200, response.text
    allowed = {h.strip() for h in response.headers["access-control-allow-headers"].lower().split(",")}
    assert {h.strip() for h in asked.split(",")} <= allowed


async def test_a_413_carries_cors_headers_so_a_page_can_read_it(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", content=b"x" * 8192, headers=AUTH | {"Origin": "http://127.0.0.1:8123"}
    )
    assert_openai_error(response, 413, "request_too_large")
    assert response.headers["access-control-allow-origin"] == "http://127.0.0.1:8123"


async def test_a_compressed_body_is_a_415_saying_to_send_it_uncompressed(client: httpx.AsyncClient) -> None:
    """gzip was read as text ("can't decode byte 0x8b") and a mislabelled body was taken as it came."""
    body = gzip.compress(b'{"model": "m", "prompt": "x"}')
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/requests", "/v1/embeddings", "/v1/responses"):
        for encoding, content in (("gzip", body), ("br", b'{"model": "m", "prompt": "x"}')):
            response = await client.post(path, content=content, headers=AUTH | {"Content-Encoding": encoding})
            assert_openai_error(response, 415, "unsupported_content_encoding")
            assert encoding in response.json()["error"]["message"] and response.headers["accept-encoding"] == "identity"


async def test_health_and_metrics(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json()["status"] == "ok"
    assert (await client.get("/health")).status_code == 200  # where vLLM answers it and load generators look
    for path in ("/health", "/healthz"):  # uptime checks send HEAD
        assert (await client.head(path)).status_code == 200
    assert (await client.head("/readyz")).status_code == 503  # Kafka and Redis point at a closed port here
    await client.post("/v1/chat/completions", json=CHAT)
    text = (await client.get("/metrics")).text
    assert 'sluicegate_ingress_requests_total{method="POST",route="/v1/chat/completions",status="401"} 1.0' in text
    assert "sluicegate_ingress_request_seconds_bucket" in text


def test_cors_origins_include_the_public_result_service() -> None:
    origins = browser_origins(settings(public_stream_url="wss://chat.example.org/base", cors_origins=" https://a.b/ ,"))
    assert origins == [
        "http://127.0.0.1:8123",
        "http://localhost:8123",
        "https://chat.example.org",
        "https://a.b",
    ]


def test_refuses_to_start_without_keys_or_secret() -> None:
    with pytest.raises(ValueError, match="no API keys configured"):
        create_app(settings(api_keys=""))
    with pytest.raises(ValueError, match="STREAM_TOKEN_SECRET"):
        create_app(settings(stream_token_secret=""))
    assert isinstance(create_app(settings(api_keys="", allow_anonymous=True)), FastAPI)
