"""Ingress under backbone faults, on a private Kafka broker and Redis server (``cli.backbone.devstack`` on ports of
their own), so the shared test broker is never disturbed.

Kafka: the broker is killed (SIGKILL) under steady load and restarted. Every response must come back promptly
(202 before and after, a clear 503 while the broker is down, never a hang); ingress must recover by itself; every
accepted request must be on its topic exactly once after the restart (acks=all: acknowledged means durable). A
request answered 503 may still reach Kafka from the producer's buffer once the broker returns; it must then
carry the cancel marker that makes workers drop it.

Redis: the server is stopped and restarted. Ingress answers 503 naming Redis (submit, status, models, readiness)
and recovers by itself; nothing is published while it cannot record a request. The Files and Batches routes answer
the same 503 + Retry-After, and a refused upload leaves no stored copy.

Each test prints one ``fault-figures`` line with what it injected and observed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from aiokafka import TopicPartition
from ingress_support import KEY, MODEL, running_ingress
from needs import require
from ports import free_port
from redis.asyncio import Redis

from cli.backbone import devstack
from schemas import CancelRequest, InferenceRequest, Names
from sluicegate.kafka import create_consumer
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

REPO_ROOT = Path(__file__).resolve().parents[2]
KAFKA_TIMEOUT_S = 2.0
# A 503 must come back within the Kafka timeout plus scheduling slack on a busy 2-core machine.
PROMPT_S = 2 * KAFKA_TIMEOUT_S + 1.0
PARTITIONS = 2


@dataclass
class PrivateStack:
    """A Kafka broker and a Redis server started for this module only."""

    settings: Settings
    info: devstack.StackInfo

    def kill_kafka(self) -> None:
        os.kill(self.info.kafka_pid, signal.SIGKILL)

    def stop_redis(self) -> None:
        devstack.down(self.settings, services=("redis",))

    def restart(self) -> None:
        # Starts whatever is not running; the broker keeps its data folder, Redis its snapshot.
        self.info = devstack.up(self.settings)


@pytest.fixture(scope="module")
def stack() -> Iterator[PrivateStack]:
    kafka_port = free_port(with_successor=True)
    redis_port = free_port((kafka_port, kafka_port + 1))
    config = Settings(
        state_dir=REPO_ROOT / ".sluicegate", kafka_port=kafka_port, redis_port=redis_port, topic_partitions=PARTITIONS
    )
    try:
        info = devstack.up(config)
    except devstack.DevStackError as exc:
        require(False, "a private Kafka/Redis (the Kafka jars, redis-server)", str(exc))
        raise
    private = PrivateStack(config, info)
    try:
        yield private
    finally:
        devstack.down(config)
        state = config.state_dir.resolve()
        for folder in (state / f"kafka-{kafka_port}", state / f"redis-{redis_port}"):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def settings(stack: PrivateStack, unique_prefix: str) -> Settings:
    return Settings(
        kafka_bootstrap=stack.info.kafka_bootstrap,
        redis_url=stack.info.redis_url,
        topic_prefix=unique_prefix,
        topic_partitions=PARTITIONS,
        api_keys=KEY,
        stream_token_secret="fault-secret",
        served_models=MODEL,
        kafka_timeout_s=KAFKA_TIMEOUT_S,
        # Limits on, so the Redis rate-limit script and the backlog reads are part of every request.
        limit_rps=10_000,
        max_backlog_per_model=100_000,
    )


@dataclass
class Outcome:
    phase: str
    status: int
    elapsed_s: float
    finished_at: float
    request_id: str
    error: str = ""


@dataclass
class Load:
    """Submits requests from a few concurrent clients until stopped; ``phase`` labels what is going on."""

    url: str
    clients: int = 4
    phase: str = "before"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _client(self, index: int) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=20) as http:
            sent = 0
            while not self._stop.is_set():
                phase, started = self.phase, time.monotonic()
                body = {"model": MODEL, "prompt": f"client {index} request {sent}", "max_tokens": 4}
                response = await http.post("/v1/requests", json=body)
                sent += 1
                error = response.json()["error"]["message"] if response.status_code >= 400 else ""
                rid = response.headers.get("x-request-id", "")
                now = time.monotonic()
                self.outcomes.append(Outcome(phase, response.status_code, now - started, now, rid, error))
                if response.status_code != 202:
                    await asyncio.sleep(0.05)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)

    def count(self, phase: str | None = None, status: int | None = None) -> int:
        return sum(1 for o in self.outcomes if phase in (None, o.phase) and status in (None, o.status))

    async def until(self, predicate: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():  # type: ignore[operator]
            assert time.monotonic() < deadline, "load did not reach the expected state in time"
            await asyncio.sleep(0.05)


async def read_all(settings: Settings, idle_s: float = 2.0) -> list[InferenceRequest]:
    """Every record on the model's request topics, from the beginning, until none arrives for ``idle_s``."""
    names = Names(settings.topic_prefix)
    consumer = create_consumer(group_id=None, settings=settings)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(t, p) for t in names.request_topics(MODEL) for p in range(PARTITIONS)])
        records = []
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < idle_s:
            batch = await consumer.getmany(timeout_ms=200)
            for found in batch.values():
                records.extend(found)
                quiet_since = time.monotonic()
    finally:
        await consumer.stop()
    return [InferenceRequest.model_validate_json(r.value) for r in records]


async def backlog_gauge(url: str) -> float:
    """The ingress's latest backlog estimate for the model, from its Prometheus metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    prefix = f'sluicegate_ingress_backlog_requests{{model="{MODEL}"}} '
    values = [float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


def report(test: str, figures: dict[str, object]) -> None:
    print(f"\nfault-figures {test} {json.dumps(figures, sort_keys=True)}")


async def test_kafka_crash_under_load_loses_nothing_and_recovers(stack: PrivateStack, settings: Settings) -> None:
    redis = Redis.from_url(settings.redis_url)
    names = Names(settings.topic_prefix)
    async with running_ingress(settings) as url, Load(url).running() as load:
        await load.until(lambda: load.count("before", 202) >= 40, timeout_s=60)
        deadline = time.monotonic() + 15
        while (backlog_at_kill := await backlog_gauge(url)) < 40:
            assert time.monotonic() < deadline, f"backlog estimate stuck at {backlog_at_kill}"
            await asyncio.sleep(0.2)
        load.phase = "outage"
        killed_at = time.monotonic()
        stack.kill_kafka()
        await load.until(lambda: load.count("outage", 503) >= 8, timeout_s=30)
        # While the broker restarts (JVM start, log recovery) requests may already succeed again.
        load.phase = "restarting"
        restart_started = time.monotonic()
        await asyncio.to_thread(stack.restart)
        broker_back_s = time.monotonic() - restart_started
        load.phase = "after"
        back_at = time.monotonic()
        await load.until(lambda: load.count("after", 202) >= 40, timeout_s=60)
        # The backlog reader recovered too: no read succeeds while the broker is down, so its estimate (with no
        # worker: every record on the topics) moves past the last value before the kill only after a new read.
        deadline = time.monotonic() + 15
        while (backlog_after := await backlog_gauge(url)) <= backlog_at_kill:
            assert time.monotonic() < deadline, f"backlog estimate stuck at {backlog_after}"
            await asyncio.sleep(0.2)
        backlog_recovered_s = time.monotonic() - back_at
    first_202_after = min(o.finished_at for o in load.outcomes if o.phase == "after" and o.status == 202)

    outcomes = load.outcomes
    statuses = Counter((o.phase, o.status) for o in outcomes)
    assert {status for _, status in statuses} <= {202, 503}, statuses
    slowest = max(o.elapsed_s for o in outcomes)
    assert slowest < PROMPT_S, f"a response took {slowest:.1f}s"
    outage_errors = {o.error.split(":")[0] for o in outcomes if o.status == 503}
    assert outage_errors == {"Kafka is unavailable"}, outage_errors
    assert all(o.request_id for o in outcomes), "every answer names its request"

    accepted = {o.request_id for o in outcomes if o.status == 202}
    refused = {o.request_id for o in outcomes if o.status == 503}
    on_kafka = Counter(r.request_id for r in await read_all(settings))
    lost = accepted - set(on_kafka)
    duplicates = sum(n - 1 for n in on_kafka.values() if n > 1)
    phantoms = set(on_kafka) - accepted
    assert not lost, f"{len(lost)} accepted requests are not on Kafka"
    assert duplicates == 0
    assert phantoms <= refused
    for rid in phantoms:
        assert CancelRequest.model_validate_json(await redis.get(names.cancel_key(rid))).reason == "publish_failed"
    await redis.aclose()

    report(
        "kafka_sigkill_restart",
        {
            "injected": "SIGKILL of the only broker under 4 concurrent submitters, then restart on the same data",
            "responses": {f"{phase}_{status}": n for (phase, status), n in sorted(statuses.items())},
            "kill_to_broker_ready_s": round(back_at - killed_at, 2),
            "broker_restart_s": round(broker_back_s, 2),
            "slowest_response_s": round(slowest, 2),
            "backlog_estimate_at_kill_and_after": [backlog_at_kill, backlog_after],
            "backlog_estimate_fresh_after_broker_ready_s": round(backlog_recovered_s, 2),
            "first_202_after_broker_ready_s": round(first_202_after - back_at, 3),
            "records_on_kafka": sum(on_kafka.values()),
            "lost": len(lost),
            "duplicates": duplicates,
            "refused_but_published_with_cancel_marker": len(phantoms),
        },
    )


async def test_redis_outage_is_a_clear_503_and_recovers(
    stack: PrivateStack, settings: Settings, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"files_url": str(tmp_path)})
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "remember me", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}}
    upload = (json.dumps(line) + "\n").encode()
    batch = {"input_file_id": "file-abc", "endpoint": "/v1/completions", "completion_window": "24h"}
    async with running_ingress(settings) as url, httpx.AsyncClient(base_url=url, headers=headers, timeout=20) as http:
        before = [await http.post("/v1/requests", json=body) for _ in range(10)]
        assert {r.status_code for r in before} == {202}
        accepted = [r.json()["request_id"] for r in before]

        stopped_at = time.monotonic()
        await asyncio.to_thread(stack.stop_redis)
        answers: list[tuple[str, int, float, str]] = []
        for path, method in (
            ("/v1/requests", "POST"),
            (f"/v1/requests/{accepted[0]}", "GET"),
            (f"/v1/requests/{accepted[0]}", "DELETE"),
            ("/v1/models", "GET"),
            ("/v1/chat/completions", "POST"),
            ("/readyz", "GET"),
            # The Files and Batches APIs keep their records in Redis too.
            ("/v1/files", "POST"),
            ("/v1/files", "GET"),
            ("/v1/files/file-abc", "GET"),
            ("/v1/files/file-abc/content", "GET"),
            ("/v1/files/file-abc", "DELETE"),
            ("/v1/batches", "POST"),
            ("/v1/batches", "GET"),
            ("/v1/batches/batch_abc", "GET"),
            ("/v1/batches/batch_abc/cancel", "POST"),
        ) * 2:
            started = time.monotonic()
            payload = {"/v1/requests": body, "/v1/chat/completions": chat, "/v1/batches": batch}.get(path)
            if path == "/v1/files":
                files = {"file": ("in.jsonl", upload)} if method == "POST" else None
                response = await http.request(method, path, files=files, data={"purpose": "batch"} if files else None)
            else:
                response = await http.request(method, path, json=payload if method == "POST" else None)
            if path != "/readyz":  # a probe's answer, not an API error
                assert response.headers.get("retry-after") == "1", (path, response.headers)
            answer = response.json()
            # Errors carry OpenAI's shape; /readyz lists each backbone's problem.
            text = answer["error"]["message"] if "error" in answer else answer.get("redis", "")
            answers.append((path, response.status_code, time.monotonic() - started, text))
        assert {status for _, status, _, _ in answers} == {503}, answers
        assert all(text.startswith("Redis is unavailable: ") for *_, text in answers), answers
        # An upload refused for want of Redis leaves no stored copy behind.
        assert not await asyncio.to_thread(lambda: [p for p in tmp_path.rglob("*") if p.is_file()])
        slowest = max(elapsed for _, _, elapsed, _ in answers)
        assert slowest < PROMPT_S, f"a response took {slowest:.1f}s"

        await asyncio.to_thread(stack.restart)
        restarted_at = time.monotonic()
        recovered: httpx.Response | None = None
        attempts = 0
        while recovered is None or recovered.status_code != 202:
            assert time.monotonic() - restarted_at < 30, recovered.text if recovered else "no answer"
            recovered = await http.post("/v1/requests", json=body)
            attempts += 1
        recovery_s = time.monotonic() - restarted_at
        accepted.append(recovered.json()["request_id"])
        # Records written before the restart survived it (Redis saved its snapshot on the way down).
        kept = [(await http.get(f"/v1/requests/{rid}")).status_code for rid in accepted[:10]]
        assert kept == [200] * 10
        assert (await http.get("/readyz")).status_code == 200

    on_kafka = Counter(r.request_id for r in await read_all(settings))
    assert set(on_kafka) == set(accepted) and max(on_kafka.values()) == 1
    report(
        "redis_stop_restart",
        {
            "injected": "SIGTERM of the Redis server (snapshot on shutdown), then restart",
            "accepted_before": 10,
            "answers_while_down": len(answers),
            "all_503": True,
            "slowest_response_while_down_s": round(slowest, 3),
            "outage_s": round(restarted_at - stopped_at, 2),
            "attempts_until_202_after_restart": attempts,
            "recovery_after_restart_s": round(recovery_s, 3),
            "records_kept_across_restart": sum(1 for s in kept if s == 200),
            "records_on_kafka": sum(on_kafka.values()),
            "lost": len(set(accepted) - set(on_kafka)),
            "duplicates": sum(n - 1 for n in on_kafka.values() if n > 1),
            "published_while_down": len(set(on_kafka) - set(accepted)),
        },
    )


async def test_a_hung_redis_is_a_503_within_the_bound_not_a_wait_as_long_as_it_hangs(
    stack: PrivateStack, settings: Settings
) -> None:
    """A Redis server that stops answering (SIGSTOP: a stalled host, a long fork) without closing its sockets: a
    request gets its 503 within ``ingress_redis_timeout_s`` (once, not retried), and the first request after the
    server resumes is accepted."""
    settings = settings.model_copy(update={"ingress_redis_timeout_s": 1.0})
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "hang on", "max_tokens": 4}
    redis_pid = stack.info.redis_pid
    assert redis_pid is not None
    async with running_ingress(settings) as url, httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        assert (await http.post("/v1/requests", json=body)).status_code == 202
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            hung = await http.post("/v1/requests", json=body)
            waited = time.monotonic() - started
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        assert hung.status_code == 503 and hung.json()["error"]["message"].startswith("Redis is unavailable"), hung.text
        # The rate-limit script is the one command before the answer: one timeout of 1 s, plus the request's work.
        assert waited < 1.0 + PROMPT_S, f"{waited:.1f} s"
        deadline = time.monotonic() + 15
        while (after := await http.post("/v1/requests", json=body)).status_code != 202:
            assert time.monotonic() < deadline, after.text
