"""The backlog seconds a worker samples ride in its heartbeat for admission: finite figures only (a backlog with no
measured generation rate yet is infinite, and admission must not refuse on it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from gpu_workers.worker.telemetry import WorkerTelemetry
from schemas import Names


class _Consumer:
    """The group consumer as the sampler sees it: assigned partitions, their end offsets and positions."""

    def __init__(self, ends: dict[TopicPartition, int], positions: dict[TopicPartition, int]) -> None:
        self.ends, self.positions = ends, positions

    def assignment(self) -> set[TopicPartition]:
        return set(self.ends)

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.ends[tp] for tp in tps}

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]


async def test_only_finite_backlog_seconds_are_published() -> None:
    engine: Any = SimpleNamespace(stats=lambda: SimpleNamespace(num_running=0), add_delta_observer=lambda _: None)
    telemetry = WorkerTelemetry(engine, "m", "w")
    names = Names()
    telemetry.set_topics({names.request_topic("m", t): t for t in ("interactive", "standard", "batch")})
    assert telemetry.backlog_seconds is None  # nothing sampled yet: the heartbeat carries none
    standard = TopicPartition(names.request_topic("m", "standard"), 0)
    interactive = TopicPartition(names.request_topic("m", "interactive"), 0)
    consumer: Any = _Consumer({standard: 10, interactive: 4}, {standard: 7, interactive: 4})
    await telemetry._sample_once(consumer, engine)
    # Nothing waits at interactive (0 s); 3 standard requests and no measured rate: no figure at or below it.
    assert telemetry.backlog_seconds == {"interactive": 0.0}
