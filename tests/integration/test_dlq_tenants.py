"""``sluicegate dlq list --tenant T`` and ``replay --tenant T`` on a real Kafka and Redis with tenants apart: only
``llm.dlq.<T>`` is read, replays go to ``llm.inbound.<T>`` only, and a letter naming another tenant stays put."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ingress_support import consume, reader
from redis.asyncio import Redis

from schemas import DeadLetter, InferenceRequest
from sluicegate.dead_letter_admin import list_entries, replay
from sluicegate.kafka import create_producer, ensure_topics
from sluicegate.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cli", "dlq", *args]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def _letter(request: InferenceRequest, source: str, *, without_tenant: bool = False) -> bytes:
    payload = request.model_dump_json(exclude={"tenant"} if without_tenant else None)
    letter = DeadLetter(reason="processing_failed", source_topic=source, payload=payload, request_id=request.request_id)
    return letter.model_dump_json().encode()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_tenants_dlq_is_listed_and_replayed_to_its_own_topic_only(
    test_settings: Settings, redis: Redis, cleanup_topics: None
) -> None:
    settings = test_settings.model_copy(update={"tenant_topics": True, "tenants": "a,b", "topic_partitions": 1})
    names = settings.names
    dlq_a, dlq_b = names.dlq_topic_of("a"), names.dlq_topic_of("b")
    inbound_a, inbound_b = names.tenant_inbound_topic("a"), names.tenant_inbound_topic("b")
    await ensure_topics(settings.kafka_bootstrap, dict.fromkeys([dlq_a, dlq_b, inbound_a, inbound_b], 1), 1)
    own = InferenceRequest(request_id="own-a", model="m", prompt="hi", tenant="a")
    unnamed = InferenceRequest(request_id="unnamed-a", model="m", prompt="hi")  # as a Kafka-native record: no tenant
    foreign = InferenceRequest(request_id="names-b", model="m", prompt="hi", tenant="b")
    of_b = InferenceRequest(request_id="own-b", model="m", prompt="hi", tenant="b")
    producer = create_producer(settings)
    await producer.start()
    try:
        for request, without in ((own, False), (unnamed, True), (foreign, False)):
            await producer.send_and_wait(dlq_a, _letter(request, inbound_a, without_tenant=without))
        await producer.send_and_wait(dlq_b, _letter(of_b, inbound_b))
    finally:
        await producer.stop()

    listed = await list_entries(settings, tenant="a")
    assert [e.request_id for e in listed] == ["own-a", "unnamed-a", "names-b"]
    assert [e.request_id for e in await list_entries(settings, tenant="b")] == ["own-b"]
    assert await list_entries(settings) == []  # the shared llm.dlq holds none of them

    # The command line reads the same topic, named by --tenant.
    env = {
        "SLUICEGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "SLUICEGATE_REDIS_URL": settings.redis_url,
        "SLUICEGATE_TOPIC_PREFIX": names.prefix,
        "SLUICEGATE_TENANT_TOPICS": "true",
        "SLUICEGATE_TENANTS": "a,b",
    }
    done = await asyncio.to_thread(_cli, env, "list", "--tenant", "b")
    assert done.returncode == 0, done.stderr
    assert "request_id=own-b" in done.stdout and "own-a" not in done.stdout

    outcomes = {o.entry.request_id: o for o in await replay(settings, tenant="a")}
    assert outcomes["own-a"].action == outcomes["unnamed-a"].action == "replayed"
    assert outcomes["own-a"].message == f"to {inbound_a}"
    assert outcomes["names-b"].action == "skipped" and "names tenant 'b'" in outcomes["names-b"].message
    async with reader(settings, inbound_a, inbound_b, partitions=1) as replayed:
        got = await consume(replayed, 2)
        assert not await replayed.getmany(timeout_ms=1000)  # nothing more: not names-b, and nothing to b's topic
    assert {(r.topic, r.key) for r in got} == {(inbound_a, b"own-a"), (inbound_a, b"unnamed-a")}


def test_the_tenant_option_refuses_a_tenant_it_cannot_read() -> None:
    env = {"SLUICEGATE_TENANT_TOPICS": "true", "SLUICEGATE_TENANTS": "a,b"}
    for extra, says in (
        ({"SLUICEGATE_TENANT_TOPICS": "false"}, "needs tenants apart (SLUICEGATE_TENANT_TOPICS=true)"),
        ({}, "--tenant 'c' is not one of the tenants (SLUICEGATE_TENANTS: a, b)"),
    ):
        done = _cli(env | extra, "replay", "--tenant", "c")
        assert done.returncode == 2 and "sluicegate: error: --tenant 'c' " in done.stderr, done.stderr
        assert says in done.stderr
