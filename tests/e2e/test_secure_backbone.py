"""Every service at once on a secured backbone: Kafka over SASL_SSL (SCRAM-SHA-512, a private CA) and a TLS-only
Redis where each service logs in as its own ACL user. Ingress, router (with the usage rollup in it), result
service, a worker and the Celery batch worker serve the official OpenAI SDK's streamed chat, a WebSocket read
resumed with ``last_id``, a Kafka-native request written by kafka-python (an outside producer with its own
SASL_SSL settings, not the pipeline's aiokafka) and read back from its Redis stream, and one batch; no service
was refused a Redis command and none logged a password."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kafka import KafkaProducer
from secure_kafka import SecureKafka
from secure_redis import SecureRedis

from schemas import STREAM_FIELD, Names, parse_stream_event

from .batch_support import TERMINAL, chat_line, wait_until, write_jsonl
from .conftest import Pipeline, Service, running_pipeline
from .test_pipeline_native import disconnect_and_resume, native_request

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

#: Subcommands the harness starts, each given its own Redis user.
SERVICES = ("ingress", "router", "result-service", "worker", "batch-worker")


@pytest.fixture(scope="module")
def pipeline(
    secure_kafka: SecureKafka,
    secure_redis_server: SecureRedis,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pipeline]:
    redis_tls = secure_redis_server
    service_env = {service: {"SLUICEGATE_REDIS_URL": redis_tls.url(service)} for service in SERVICES}
    with running_pipeline(
        secure_kafka.bootstrap,
        redis_tls.url(),
        tiny_model_dir,
        tmp_path_factory,
        secure_kafka.env(),
        prefix=redis_tls.prefix,
        service_env=service_env,
    ) as pipe:
        yield pipe


def test_sdk_stream_is_served_and_rolled_up(pipeline: Pipeline) -> None:
    client = pipeline.openai(max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=pipeline.model,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # The router's usage rollup reads the ledger over SASL_SSL and writes the aggregates as its Redis user.
    deadline = time.monotonic() + 60
    while True:
        body = httpx.get(f"{pipeline.ingress_url}/v1/usage", headers=pipeline.headers(), timeout=10).json()
        if body["totals"]["output_tokens"] >= 6:
            break
        assert time.monotonic() < deadline, f"usage never rolled up: {body}"
        time.sleep(0.5)


async def test_websocket_read_resumes_with_last_id(pipeline: Pipeline) -> None:
    # Whether the worker was still generating at the hang-up depends on the machine's load; the seam is checked
    # either way (every event once, in order, equal to an uninterrupted read and to the stored result).
    await disconnect_and_resume(pipeline, 200)


def _stream_events(client: redis.Redis, key: str, timeout_s: float = 60) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = [parse_stream_event(fields[STREAM_FIELD.encode()]) for _, fields in client.xrange(key)]
        if events and events[-1].type in ("done", "error"):
            return events
        assert time.monotonic() < deadline, f"{key} did not end: {events[-3:]}"
        time.sleep(0.05)


def test_kafka_native_request_from_kafka_python(
    pipeline: Pipeline, secure_kafka: SecureKafka, secure_redis_server: SecureRedis
) -> None:
    body = native_request(pipeline, max_tokens=7)
    producer = KafkaProducer(
        bootstrap_servers=secure_kafka.bootstrap,
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="sluicegate",
        sasl_plain_password=secure_kafka.password(),
        ssl_cafile=str(secure_kafka.cafile),
        acks="all",
    )
    try:
        sent = producer.send(
            Names(pipeline.prefix).inbound_topic, json.dumps(body).encode(), key=body["request_id"].encode()
        )
        sent.get(timeout=30)
    finally:
        producer.close(timeout=10)
    # Read back as the result service's user, over TLS with the test CA, as a stream reader outside the pipeline.
    client = redis.Redis.from_url(secure_redis_server.url("result-service"))
    try:
        events = _stream_events(client, Names(pipeline.prefix).stream_key(body["request_id"]))
    finally:
        client.close()
    assert events[-1].type == "done", events[-1]
    assert events[-1].usage.completion_tokens == 7
    assert sum(len(e.token_ids) for e in events if e.type == "token") == 7


def test_batch_through_the_batches_api(pipeline: Pipeline, batch_worker: Service, tmp_path: Path) -> None:
    client = pipeline.openai()
    lines = [chat_line(f"secure-{i}", pipeline.model, max_tokens=3) for i in range(2)]
    uploaded = client.files.create(file=write_jsonl(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(client, batch.id, lambda b: b.status in TERMINAL, timeout_s=180)
    assert done.status == "completed", (done, batch_worker.log())
    assert done.request_counts is not None and done.request_counts.completed == 2


def test_no_refused_command_and_no_password_in_any_log(
    pipeline: Pipeline, secure_kafka: SecureKafka, secure_redis_server: SecureRedis
) -> None:
    secrets = {"kafka": secure_kafka.password(), "redis admin": secure_redis_server.admin_password}
    secrets |= {f"redis {service}": password for service, password in secure_redis_server.passwords.items()}
    started = {service.name for service in pipeline.services}
    assert started >= {"worker-a", "router", "ingress", "result-service", "batch-worker"}
    for service in pipeline.services:
        log = service.log_path.read_text(errors="replace")
        assert "NOPERM" not in log and "no permissions" not in log, f"{service.name}:\n{service.log()}"
        leaked = [name for name, secret in secrets.items() if secret in log]
        assert not leaked, f"{service.name} logged the {', '.join(leaked)} password"
