"""A batch keeps going through a Sentinel failover of the Redis that Celery uses as its broker.

The module's pipeline sends batch tasks through ``SLUICEGATE_BATCH_BROKER_URL`` = a ``redis+sentinel://`` URL of
a primary, a replica and three Sentinels of the test's own (kombu's sentinel transport in ingress and the Celery
worker); everything else stays on the shared test Redis. Mid-batch the primary gets ``kill -9``: the Sentinels
promote the replica, Celery's consumer and ingress's sender reconnect to it, and the batch must reach
``completed`` with every ``custom_id`` in exactly one line. Run with ``-s`` for the ``FAULT-REPORT`` line.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from needs import needs

from benchmarks.redis_failover import SentinelSet, have_binaries

from .batch_support import TERMINAL, audit, chat_line, finished, wait_until, write_jsonl
from .conftest import Pipeline, Service

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    needs(have_binaries(), "redis-server and redis-sentinel", "apt-get install redis-sentinel"),
]

LINES = 200


@pytest.fixture(scope="module")
def broker_sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    group = SentinelSet(tmp_path_factory.mktemp("broker-sentinels"))
    try:
        group.start()
        asyncio.run(group.replica_in_sync())
        yield group
    finally:
        group.stop()


@pytest.fixture(scope="module")
def pipeline_env(broker_sentinels: SentinelSet) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "SLUICEGATE_BATCH_BROKER_URL": broker_sentinels.url,
        "SLUICEGATE_BATCH_VISIBILITY_TIMEOUT_S": "5",
        "SLUICEGATE_BATCH_LOCK_TTL_S": "5",
        "SLUICEGATE_BATCH_STALL_CHECK_S": "3",
        "SLUICEGATE_BATCH_TICK_S": "0.5",
        "SLUICEGATE_BATCH_CHUNK_SIZE": "25",
        # Publish the batch in steps, so the kill lands while lines are still being enqueued as well as run.
        "SLUICEGATE_BATCH_MAX_IN_FLIGHT": "60",
    }


def test_batch_completes_through_a_sentinel_failover_of_the_celery_broker(
    pipeline: Pipeline, batch_worker: Service, broker_sentinels: SentinelSet, tmp_path: Path
) -> None:
    client = pipeline.openai(max_retries=5)
    lines = [chat_line(f"line-{i:03d}", pipeline.model, max_tokens=16, ignore_eos=True) for i in range(LINES)]
    expected = {line["custom_id"] for line in lines}
    with write_jsonl(tmp_path / "batch.jsonl", lines).open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")

    batch = wait_until(client, batch.id, lambda b: finished(b) >= 30 or b.status in TERMINAL, timeout_s=180)
    assert batch.status == "in_progress", batch.model_dump_json()
    at_kill = finished(batch)
    assert at_kill < LINES // 2, f"the batch ran too fast to fail over in the middle: {at_kill} finished"
    broker_sentinels.kill("primary")
    killed_at = time.monotonic()

    batch = wait_until(client, batch.id, lambda b: b.status in TERMINAL, timeout_s=300, interval_s=0.5)
    assert batch.status == "completed", batch.model_dump_json()
    result = audit(client, batch)
    result.check_exactly_once(expected)
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
    assert all(line["response"]["status_code"] == 200 for line in result.outputs)
    assert batch_worker.alive(), batch_worker.log()  # it rode out the failover, no restart

    promoted = asyncio.run(_role(broker_sentinels.node_url("replica")))
    assert promoted == b"master"
    report(
        "batch_celery_broker_sentinel_failover",
        lines=LINES,
        finished_at_kill=at_kill,
        kill_to_completed_s=round(time.monotonic() - killed_at, 1),
        total_s=round(time.monotonic() - started, 1),
        output_lines=len(result.outputs),
        error_lines=len(result.errors),
    )


def report(name: str, **figures: object) -> None:
    print(f"\nFAULT-REPORT {json.dumps({'test': name, **figures})}")


async def _role(url: str) -> bytes:
    from sluicegate.redis_client import create_redis

    client = create_redis(url=url, socket_timeout=5)
    try:
        return bytes((await client.execute_command("ROLE"))[0])
    finally:
        await client.aclose()
