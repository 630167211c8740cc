"""The whole pipeline on a TLS-only Redis where each service logs in as its own ACL user (`sluicegate redis acls`)
and certificates are checked: a streamed chat completion (ingress, router, worker), the result service's relay, a
batch through the Celery broker over rediss://, and no service refused a command it sends (NOPERM in no log)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from secure_redis import secure_redis

from .batch_support import TERMINAL, chat_line, wait_until, write_jsonl
from .conftest import Pipeline, Service, running_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SERVICES = ("ingress", "router", "result-service", "worker", "batch-worker")


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pipeline]:
    prefix = f"t{uuid.uuid4().hex[:8]}."
    with secure_redis(tmp_path_factory.mktemp("tls-redis"), prefix) as redis:
        service_env = {service: {"SLUICEGATE_REDIS_URL": redis.url(service)} for service in SERVICES}
        with running_pipeline(
            kafka_bootstrap, redis.url(), tiny_model_dir, tmp_path_factory, {}, prefix=prefix, service_env=service_env
        ) as pipe:
            yield pipe


def test_streamed_chat_and_relay_under_service_users(pipeline: Pipeline) -> None:
    client = pipeline.openai()
    chunks = list(
        client.chat.completions.create(
            model=pipeline.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    submitted = pipeline.submit(prompt="hello", max_tokens=4)
    events = pipeline.wait_stream_end(submitted["request_id"])
    assert events[-1].type == "done", events
    # The relay reads the finished stream as its own user.
    sse = f"{pipeline.result_url}/v1/streams/{submitted['request_id']}/sse"
    with httpx.stream("GET", sse, params={"token": submitted["stream_token"]}, timeout=30) as response:
        body = response.read().decode()
    assert response.status_code == 200 and '"done"' in body, body


def test_batch_through_celery_over_tls(pipeline: Pipeline, batch_worker: Service, tmp_path: Path) -> None:
    client = pipeline.openai()
    path = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"tls-{i}", pipeline.model, max_tokens=3) for i in range(3)])
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(client, batch.id, lambda b: b.status in TERMINAL, timeout_s=180)
    assert done.status == "completed", (done, batch_worker.log())
    assert done.request_counts.completed == 3


def test_no_service_was_refused_a_command(pipeline: Pipeline) -> None:
    for service in pipeline.services:
        log = service.log_path.read_text(errors="replace")
        assert "NOPERM" not in log and "no permissions" not in log, f"{service.name}:\n{service.log()}"
