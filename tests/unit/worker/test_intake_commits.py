"""The intake's batched commits: a request that finishes while a commit is on its way to the broker gets a commit
of its own once that one returns, instead of waiting for some later request to finish. (A stand-in consumer holds
the commit in flight; the scheduling is the intake's own, no broker is reached. The e2e DLQ test checks the
committed offset on a real broker.)"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import InFlight
from gpu_workers.worker.intake import Intake
from schemas import Names

TP = TopicPartition("t", 0)


class _SlowCommits:
    """Records each commit; every commit stays in flight until the test releases it."""

    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []
        self.release = asyncio.Event()
        self.in_flight = asyncio.Event()

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))
        self.in_flight.set()
        await self.release.wait()


async def test_a_finish_during_a_commit_is_committed_after_it() -> None:
    consumer = _SlowCommits()
    intake = Intake(
        consumer=consumer,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        config=WorkerConfig(model_name="m", worker_id="w", commit_interval_s=0.01),
        names=Names(),
        in_flight=InFlight(),
        serving=None,  # type: ignore[arg-type]
        outputs=None,  # type: ignore[arg-type]
        stopping=asyncio.Event(),
    )
    for offset in (0, 1):
        intake.watermarks.started(TP, offset)
    intake.watermarks.finished(TP, 0)
    intake._schedule_commit()
    await asyncio.wait_for(consumer.in_flight.wait(), 5)
    assert consumer.commits == [{TP: 1}]
    # Offset 1 finishes while the commit of offset 0 is still on its way.
    intake.watermarks.finished(TP, 1)
    intake._schedule_commit()
    consumer.release.set()
    task: Any = intake._commit_task
    await asyncio.wait_for(task, 5)
    assert consumer.commits == [{TP: 1}, {TP: 2}]
