"""A request whose serving fails, and whose failure Redis will not record either, still reaches the dead-letter
topic, and the worker serves on: real Kafka and Redis, the tiny model in-process.

The fault is a key of the wrong type where the request's stream should be: Redis answers ``WRONGTYPE`` to the
pick-up's read, and again to the read of the failure's error event. (That second refusal once escaped the
request's task, unseen, and the record never reached the dead-letter topic.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from ingress_support import consume, reader
from redis.asyncio import Redis
from test_worker import (  # noqa: F401  (module fixture: model_dir)
    model_dir,
    publish,
    request_for,
    running_worker,
    wait_terminal,
)

from schemas import DeadLetter, Names
from schemas.names import HEADER_REASON

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def test_a_failure_redis_will_not_record_is_dead_lettered_and_the_worker_serves_on(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,  # noqa: F811
    unique_prefix: str,
) -> None:
    names = Names(unique_prefix)
    broken, after = request_for(4), request_for(4)
    redis = Redis.from_url(redis_url)
    try:
        await redis.set(names.stream_key(broken.request_id), "not a stream", ex=600)
        async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix) as worker:
            async with reader(worker.settings, names.dlq_topic, partitions=1) as dlq:
                await publish(worker, broken, after)
                events = await wait_terminal(redis, names, after.request_id)
                assert events[-1].type == "done"
                (record,) = await consume(dlq, 1)
            letter = DeadLetter.model_validate_json(record.value)
            assert letter.request_id == broken.request_id and letter.reason == "processing_failed"
            assert "ResponseError" in letter.detail  # the kind of fault, not its text
            assert dict(record.headers)[HEADER_REASON] == b"processing_failed"
            assert not worker.task.done()
    finally:
        await redis.aclose()
