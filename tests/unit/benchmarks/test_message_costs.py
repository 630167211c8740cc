"""benchmarks.message_costs: its bare app plays the submit and the stream, and its path counts name measured
operations."""

from __future__ import annotations

import json

import httpx

from benchmarks import message_costs


async def test_the_bare_app_answers_a_submit_with_202_json() -> None:
    transport = httpx.ASGITransport(app=message_costs.bare_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.post("/v1/requests", content=message_costs.BODY)
    assert response.status_code == 202 and response.json()["request_id"] == "r"


async def test_the_bare_app_streams_six_frames_then_closes() -> None:
    sent: list[dict[str, object]] = []
    inbox = [{"type": "websocket.connect"}]

    async def receive() -> dict[str, object]:
        return inbox.pop(0)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await message_costs.bare_app({"type": "websocket", "path": "/v1/streams/r"}, receive, send)
    assert [m["type"] for m in sent] == ["websocket.accept", *["websocket.send"] * 6, "websocket.close"]
    assert json.loads(str(sent[1]["text"]))["type"] == "token"


def test_the_path_counts_only_name_measured_operations() -> None:
    measured = {"wake-up", "redis", "redis-pipeline", "redis-wake", "kafka-produce", "kafka-fetch", "http", "websocket"}
    for counts in message_costs.PATH_COUNTS.values():
        assert set(counts) <= measured
