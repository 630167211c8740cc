"""Routes on the paths that bypass ingress's online endpoints, end to end: Kafka-native records written to
``llm.inbound`` by another Kafka client (kafka-python, not the pipeline's aiokafka) and naming a route are
served by the version ingress would choose (sticky per ``user``, the fast path for a short prompt, nothing for
a canary ingress rolled back), and a batch whose lines name a route completes with the chosen version in each
body's ``model``. The pipeline, the two tiny models and the routing file are test_models_and_cache's."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from kafka import KafkaProducer

from router.versions import rendezvous
from schemas import FinalResult, Names

from . import test_models_and_cache as shared
from .batch_support import audit, chat_line, wait_until, write_jsonl
from .conftest import MODEL_NAME, Pipeline, Service
from .test_models_and_cache import BIG_MODEL, BROKEN, roll_back_canary
from .test_pipeline_native import native_request, read_topic

# This module serves the same two models and routing file (its own pipeline, under its own prefix).
big_model_dir = shared.big_model_dir
pipeline_env = shared.pipeline_env
routes_file = shared.routes_file
two_models = shared.two_models

AB_WEIGHTS = {MODEL_NAME: 50.0, BIG_MODEL: 50.0}
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))


def produce_with_kafka_python(pipeline: Pipeline, bodies: list[dict[str, Any]]) -> None:
    """Write each body to ``llm.inbound`` as a producer in another stack would: kafka-python, acks=all."""
    producer = KafkaProducer(bootstrap_servers=pipeline.kafka_bootstrap, acks="all")
    try:
        for body in bodies:
            producer.send(
                Names(pipeline.prefix).inbound_topic, json.dumps(body).encode(), key=body["request_id"].encode()
            ).get(timeout=30)
    finally:
        producer.close()


async def served_by(pipeline: Pipeline, bodies: list[dict[str, Any]], timeout_s: float = 90) -> dict[str, str]:
    """Request id -> the version that served it (the ``model`` of its final result on ``llm.results``)."""
    wanted = {body["request_id"] for body in bodies}
    results = await read_topic(pipeline, Names(pipeline.prefix).results_topic, wanted, timeout_s=timeout_s)
    return {rid: FinalResult.model_validate_json(value).model for rid, (value, _) in results.items()}


def _native(pipeline: Pipeline, model: str, **fields: Any) -> dict[str, Any]:
    return native_request(pipeline, max_tokens=2, model=model, **fields)


async def test_kafka_native_records_naming_a_route_stick_per_user(two_models: Pipeline) -> None:
    users = [f"native-user-{i}" for i in range(16)]
    # Two records per user, from different tenants: the user, not the tenant, is the sticky key.
    bodies = [_native(two_models, "ab", user=user, tenant=f"tenant-{turn}") for turn in range(2) for user in users]
    produce_with_kafka_python(two_models, bodies)
    served = await served_by(two_models, bodies)
    expected = {b["request_id"]: rendezvous("ab", f"user:{b['user']}", AB_WEIGHTS) for b in bodies}
    assert served == expected
    assert set(served.values()) == {MODEL_NAME, BIG_MODEL}  # the split uses both versions
    # The same user through ingress's OpenAI API lands on the same version as on the Kafka-native path.
    client = two_models.openai()
    for user in users[:4]:
        reply = client.chat.completions.create(
            model="ab", messages=[{"role": "user", "content": "hi"}], max_tokens=1, user=user
        )
        assert reply.model == rendezvous("ab", f"user:{user}", AB_WEIGHTS)


async def test_kafka_native_short_prompts_take_the_fast_path_unless_a_version_is_pinned(
    two_models: Pipeline,
) -> None:
    short, long, pinned = (
        _native(two_models, "fast", prompt="hi"),
        _native(two_models, "fast", prompt=LONG_PROMPT),
        _native(two_models, BIG_MODEL, prompt="hi"),
    )
    chat = _native(two_models, "fast", prompt=None, messages=[{"role": "user", "content": "hello there"}])
    produce_with_kafka_python(two_models, [short, long, pinned, chat])
    served = await served_by(two_models, [short, long, pinned, chat])
    assert served == {
        short["request_id"]: MODEL_NAME,
        long["request_id"]: BIG_MODEL,
        pinned["request_id"]: BIG_MODEL,
        chat["request_id"]: MODEL_NAME,
    }


def test_a_canary_rolled_back_by_ingress_gets_no_kafka_native_record(two_models: Pipeline) -> None:
    assert roll_back_canary(two_models) >= 1
    # The router takes the rollback from Redis at its next check (SLUICEGATE_ROUTES_RELOAD_S, 0.2 s here).
    time.sleep(0.5)
    bodies = [_native(two_models, "canary") for _ in range(12)]  # sticky none: 50/50 per request before
    produce_with_kafka_python(two_models, bodies)
    # The canary never answers: a record sent there would be missing here.
    served = asyncio.run(served_by(two_models, bodies, timeout_s=60))
    assert set(served.values()) == {MODEL_NAME}
    assert f"routes.canary_rollback_adopted route=canary version={BROKEN}" in two_models.find("router").log()


def test_a_batch_naming_a_route_completes_with_the_chosen_versions(
    two_models: Pipeline, batch_worker: Service, tmp_path: Path
) -> None:
    client = two_models.openai()
    users = [f"batch-user-{i}" for i in range(8)]
    lines = [chat_line(f"ab-{user}", "ab", max_tokens=2, user=user) for user in users]
    lines += [
        chat_line(f"fast-{size}", "fast", max_tokens=2, messages=[{"role": "user", "content": prompt}])
        for size, prompt in (("short", "hi"), ("long", LONG_PROMPT))
    ]
    with write_jsonl(tmp_path / f"routes-{uuid.uuid4().hex[:6]}.jsonl", lines).open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_until(client, batch.id, lambda b: b.status in ("completed", "failed", "expired"), timeout_s=120)
    assert batch.status == "completed", batch.model_dump_json()
    result = audit(client, batch)
    assert result.errors == []
    models = {line["custom_id"]: line["response"]["body"]["model"] for line in result.outputs}
    expected = {f"ab-{user}": rendezvous("ab", f"user:{user}", AB_WEIGHTS) for user in users}
    assert models == {**expected, "fast-short": MODEL_NAME, "fast-long": BIG_MODEL}
