"""Each tier's room in the worker's intake: ``max_in_flight`` counted per tier and above, and, while a more
important tier is held, at most ``lower_tier_in_flight_while_busy`` requests of the tiers below it."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import InFlight
from gpu_workers.worker.intake import Intake
from schemas import Names
from schemas.names import Tier


def _intake(held: dict[Tier, int], **config: int) -> Intake:
    in_flight = InFlight()
    offset = 0
    for tier, count in held.items():
        for _ in range(count):
            offset += 1
            in_flight.take(TopicPartition(f"llm.m.{tier}", 0), offset, tier)
    # The rooms are arithmetic over what the worker holds: no consumer, engine or writer is reached.
    return Intake(
        consumer=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        config=WorkerConfig(model_name="m", worker_id="w", **config),
        names=Names(),
        in_flight=in_flight,
        serving=None,  # type: ignore[arg-type]
        outputs=None,  # type: ignore[arg-type]
        stopping=asyncio.Event(),
    )


def test_rooms_count_each_tier_and_those_above() -> None:
    rooms = _intake({"interactive": 2, "batch": 30}, max_in_flight=64)._rooms()
    assert rooms == {"interactive": 62, "standard": 62, "batch": 32}


def test_lower_tiers_are_held_back_while_a_higher_tier_is_held() -> None:
    config = {"max_in_flight": 64, "lower_tier_in_flight_while_busy": 8}
    rooms = _intake({"interactive": 1, "standard": 2, "batch": 3}, **config)._rooms()
    # standard: it and batch hold 5 of 8; batch: it holds 3 of 8 (each tier counts itself and those below).
    assert rooms == {"interactive": 63, "standard": 3, "batch": 5}
    assert _intake({"interactive": 1, "batch": 20}, **config)._rooms()["batch"] <= 0
    # Nothing more important held: the batch tier has its whole room back.
    assert _intake({"batch": 20}, **config)._rooms()["batch"] == 44
