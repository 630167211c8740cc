"""Requests go on through a rebalance and stop when fenced. Through the eager protocol's revoke-then-assign, the
intake commits at revoke and hands off only the requests of partitions the assignment gave to another member; a
record of a kept partition fetched again from its committed offset is skipped while it runs here. A fence stops
its request at once, once. (Stand-ins for the consumer, engine, serving and outputs record what they are asked; no
broker or Redis is reached.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.fencing import Fence
from gpu_workers.worker.in_flight import Active, InFlight
from gpu_workers.worker.intake import Intake
from schemas import Names

TOPIC = Names().request_topic("m", "standard")
KEPT, MOVED = TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)


class _Consumer:
    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = assigned
        self.commits: list[dict[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Outputs:
    def __init__(self) -> None:
        self.flushes = 0

    async def flush(self) -> None:
        self.flushes += 1


def _running(in_flight: InFlight, intake: Intake, tp: TopicPartition, offset: int, rid: str) -> Active:
    intake.watermarks.started(tp, offset)
    entry = in_flight.take(tp, offset, "standard")
    assert in_flight.claim_at_once(entry, rid)
    return entry


async def test_a_rebalance_hands_off_only_the_requests_whose_partition_moved() -> None:
    in_flight, engine, outputs = InFlight(), _Engine(), _Outputs()
    consumer = _Consumer({KEPT, MOVED})
    intake = Intake(
        consumer=consumer,  # type: ignore[arg-type]
        engine=engine,  # type: ignore[arg-type]
        config=WorkerConfig(model_name="m", worker_id="w"),
        names=Names(),
        in_flight=in_flight,
        serving=None,  # type: ignore[arg-type]
        outputs=outputs,  # type: ignore[arg-type]
        stopping=asyncio.Event(),
    )
    done_before = _running(in_flight, intake, KEPT, 0, "done-before")
    stays, goes = _running(in_flight, intake, KEPT, 1, "stays"), _running(in_flight, intake, MOVED, 0, "goes")
    in_flight.release(done_before)
    intake.watermarks.finished(KEPT, 0)
    listener = intake.rebalance_listener()

    await listener.on_partitions_revoked([KEPT, MOVED])
    assert consumer.commits == [{KEPT: 1, MOVED: 0}]  # what finished is committed; nothing stops
    assert not stays.handed_off and not goes.handed_off and engine.aborted == []

    consumer.assigned = {KEPT}
    await listener.on_partitions_assigned([KEPT])
    assert goes.handed_off and engine.aborted == ["goes"] and outputs.flushes == 1
    assert not stays.handed_off
    assert intake.watermarks.holds(KEPT, 1) and intake.watermarks.partitions() == [KEPT]

    # The kept partition is fetched again from its commit: the running request's record is not held twice.
    refetched = SimpleNamespace(topic=TOPIC, partition=0, offset=1, value=b"{}", headers=[])
    intake._hold(refetched)
    assert intake.held_by_tier()["standard"] == 0
    newer = SimpleNamespace(topic=TOPIC, partition=0, offset=2, value=b"{}", headers=[])
    intake._hold(newer)
    assert intake.held_by_tier()["standard"] == 1


async def test_a_fence_stops_its_request_at_once_and_once() -> None:
    in_flight, engine = InFlight(), _Engine()
    fence = Fence(engine, in_flight, "w")  # type: ignore[arg-type]
    entry = in_flight.take(KEPT, 0, "standard")
    assert in_flight.claim_at_once(entry, "r1")
    entry.epoch, entry.engine_ids = 1, ("r1#0", "r1#1")

    fence.refused("r1", 0, 2)  # a write of an epoch this entry no longer holds: not this entry's
    assert not entry.fenced
    fence.refused("r1", 1, 2)
    assert entry.fenced and entry.handed_off and fence.fenced == 1
    fence.refused("r1", 1, 2)  # its other writes of the same flush
    fence.refused("gone", 1, 2)  # a request no longer held here
    assert fence.fenced == 1
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert engine.aborted == ["r1#0", "r1#1"]
