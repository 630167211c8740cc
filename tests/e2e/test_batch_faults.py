"""A 500-line batch survives ``kill -9`` of its Celery worker and of the GPU worker in the middle of its run.

Replacements start as a supervisor would start them; the batch still completes and every ``custom_id`` appears
exactly once across the output and error files (a retried Celery task must never enqueue a line twice, and a
re-delivered Kafka record must never produce a second output line). The whole flow uses the official ``openai``
SDK. Run with ``-s`` for the ``FAULT-REPORT`` line quoted in docs/reliability.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .batch_support import TERMINAL, audit, chat_line, finished, wait_until, write_jsonl
from .conftest import Pipeline, Service

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

LINES = 500
#: Lines whose body ingress refuses (temperature above 2): each becomes an error line, not a failed batch.
BAD_LINES = frozenset({7, 123, 321, 444})


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        # A killed Celery worker's unacknowledged task comes back after this, and its lock frees after this.
        "SLUICEGATE_BATCH_VISIBILITY_TIMEOUT_S": "5",
        "SLUICEGATE_BATCH_LOCK_TTL_S": "5",
        "SLUICEGATE_BATCH_STALL_CHECK_S": "3",
        "SLUICEGATE_BATCH_TICK_S": "0.5",
        "SLUICEGATE_BATCH_CHUNK_SIZE": "50",
        # Publish the batch in steps, so the kill lands while lines are still being enqueued as well as run.
        "SLUICEGATE_BATCH_MAX_IN_FLIGHT": "150",
    }


def test_batch_survives_kill_9_of_celery_and_gpu_worker(
    pipeline: Pipeline, batch_worker: Service, tmp_path: Path
) -> None:
    client = pipeline.openai(max_retries=5)
    lines = [
        chat_line(
            f"line-{i:03d}", pipeline.model, max_tokens=16, ignore_eos=True, temperature=7 if i in BAD_LINES else 0
        )
        for i in range(LINES)
    ]
    expected = {line["custom_id"] for line in lines}
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")

    # In the middle: some lines finished, most not.
    batch = wait_until(client, batch.id, lambda b: finished(b) >= 40 or b.status in TERMINAL, timeout_s=180)
    assert batch.status == "in_progress", batch.model_dump_json()
    at_kill = finished(batch)
    assert at_kill < LINES // 2, f"the batch ran too fast to be killed in the middle: {at_kill} finished"
    gpu_worker = pipeline.find("worker-a")
    pipeline.kill_group(batch_worker)
    pipeline.kill(gpu_worker)
    killed_at = time.monotonic()

    # The supervisor brings replacements (under new names: the dead worker's heartbeat entry is stale).
    pipeline.start_batch_worker("batch-worker-2")
    pipeline.start_worker("worker-b")

    batch = wait_until(client, batch.id, lambda b: b.status in TERMINAL, timeout_s=420, interval_s=0.5)
    assert batch.status == "completed", batch.model_dump_json()
    result = audit(client, batch)
    result.check_exactly_once(expected)

    counts = batch.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (LINES, LINES - len(BAD_LINES), len(BAD_LINES))
    assert len(result.outputs) == counts.completed and len(result.errors) == counts.failed
    assert {e["custom_id"] for e in result.errors} == {f"line-{i:03d}" for i in BAD_LINES}
    for line in result.outputs:
        response = line["response"]
        assert response["status_code"] == 200, line
        assert response["body"]["choices"][0]["message"]["content"], line
        assert line["error"] is None, line
    for line in result.errors:
        assert line["error"] or (line["response"] and line["response"]["status_code"] >= 400), line

    print(
        "\nFAULT-REPORT "
        + json.dumps(
            {
                "test": "batch_kill_9",
                "lines": LINES,
                "finished_at_kill": at_kill,
                "recovery_to_completed_s": round(time.monotonic() - killed_at, 1),
                "total_s": round(time.monotonic() - started, 1),
                "output_lines": len(result.outputs),
                "error_lines": len(result.errors),
            }
        )
    )
