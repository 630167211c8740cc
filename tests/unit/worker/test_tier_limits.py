"""Each tier's room in the worker's intake: ``max_in_flight`` counted per tier and above; while a more important
tier is busy (held, or taken within the busy window), at most ``lower_tier_in_flight_while_busy`` requests of the
tiers below it, and the batch tier starting at most ``batch_rate_while_busy`` a second."""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import InFlight
from gpu_workers.worker.intake import Intake
from gpu_workers.worker.tier_limits import TierLimits
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


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rooms(clock: _Clock, **config: float) -> TierLimits:
    return TierLimits(WorkerConfig(model_name="m", worker_id="w", **config), clock=clock)  # type: ignore[arg-type]


def test_a_tier_stays_busy_for_the_window_after_it_last_took_a_request() -> None:
    clock = _Clock()
    rooms = _rooms(clock, max_in_flight=64, lower_tier_in_flight_while_busy=8, busy_window_s=2.0)
    assert rooms.rooms({"batch": 20})["batch"] == 44
    rooms.taken("interactive")  # taken and already finished: nothing of it is held
    clock.now += 1.9
    assert rooms.rooms({"batch": 20})["batch"] <= 0
    clock.now += 0.2
    assert rooms.rooms({"batch": 20})["batch"] == 44


def test_the_batch_tier_is_paced_while_a_more_important_tier_is_busy() -> None:
    clock = _Clock()
    rooms = _rooms(clock, max_in_flight=64, batch_rate_while_busy=4.0, busy_window_s=2.5)
    # Alone, the batch tier takes all its room and is never told to wait.
    rooms.taken("batch")
    assert rooms.rooms({"batch": 1})["batch"] == 63
    rooms.taken("standard")
    starts = []
    for tick in range(16):  # two seconds in 1/8 s ticks (exact in binary)
        room = rooms.rooms({})["batch"]
        assert room in (0, 1)  # one at a time
        if room:
            rooms.taken("batch")
            starts.append(tick / 8)
        else:
            wait = rooms.paced_wait_s()
            assert wait is not None and 0 < wait <= 0.25
        clock.now += 0.125
    assert starts == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]  # 4 a second, evenly spaced
    # The standard request was taken 2 s ago and the window is 2.5 s: still paced; after it, free again.
    assert rooms.rooms({})["batch"] == 1
    clock.now += 0.5
    assert rooms.rooms({})["batch"] == 64
    # Held counts as busy however long ago it was taken.
    assert rooms.rooms({"interactive": 1})["batch"] in (0, 1)


def test_pacing_leaves_the_more_important_tiers_alone() -> None:
    clock = _Clock()
    rooms = _rooms(clock, max_in_flight=64, batch_rate_while_busy=1.0)
    rooms.taken("interactive")
    rooms.taken("batch")
    assert rooms.rooms({"interactive": 1, "batch": 1}) == {"interactive": 63, "standard": 63, "batch": 0}


def test_no_batch_start_while_a_more_important_request_awaits_its_first_token() -> None:
    clock = _Clock()
    rooms = _rooms(clock, max_in_flight=64, batch_rate_while_busy=4.0)
    rooms.taken("interactive")
    clock.now += 1.0  # the pace alone would let a batch request start now
    assert rooms.rooms({"interactive": 1})["batch"] == 1
    assert rooms.rooms({"interactive": 1}, awaiting_first_token=[("interactive", clock.now - 0.01)])["batch"] == 0
    wait = rooms.paced_wait_s()
    assert wait is not None and 0 < wait < 0.1  # look again soon: the first token is a few ms away
    # A request that has waited past the hold no longer keeps the batch out (nothing starves behind it).
    assert rooms.rooms({"interactive": 1}, awaiting_first_token=[("interactive", clock.now - 0.6)])["batch"] == 1
    # Unpaced, the hold does not apply either.
    unpaced = _rooms(clock, max_in_flight=64)
    assert unpaced.rooms({"interactive": 1}, awaiting_first_token=[("interactive", clock.now)])["batch"] == 63
