"""The intake starts what it holds in its tier's room, tenant by tenant by tokens: with room for two, tenant A's
backlog of long prompts fetched ahead of tenant B's short ones does not keep B's out, and each finish settles the
tenant's charge to the tokens the request used. (A stand-in ``Serving`` finishes requests when told; the ordering
is the intake's own arithmetic, no broker or engine is reached.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import Active, InFlight
from gpu_workers.worker.intake import Intake, start_cost
from schemas import InferenceRequest, Names, SamplingOptions


class _Serving:
    """Serves a request until the test finishes it, reporting ``used`` tokens."""

    fatal = None

    def __init__(self, in_flight: InFlight) -> None:
        self.in_flight = in_flight
        self.started: list[str] = []
        self.finish: dict[str, asyncio.Event] = {}

    def start_early(self, request: InferenceRequest, entry: Active) -> None:
        self.started.append(request.request_id)
        self.finish[request.request_id] = asyncio.Event()

    async def serve(self, record: Any, entry: Active, parsed: Any) -> bool:
        await self.finish[entry.request_id].wait()
        entry.used_tokens = len(parsed.prompt) + 1  # it stopped after one output token
        self.in_flight.release(entry)
        return True


def _record(offset: int, rid: str, tenant: str, prompt_len: int) -> SimpleNamespace:
    request = InferenceRequest(
        request_id=rid,
        model="m",
        tenant=tenant,
        prompt=list(range(3, 3 + prompt_len)),
        sampling=SamplingOptions(max_tokens=8),
    )
    topic, value = Names().request_topic("m", "standard"), request.model_dump_json().encode()
    return SimpleNamespace(topic=topic, partition=0, offset=offset, value=value, headers=[])


async def test_a_short_tenant_is_started_in_the_room_a_long_backlog_would_have_filled() -> None:
    in_flight = InFlight()
    serving = _Serving(in_flight)
    intake = Intake(
        consumer=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        config=WorkerConfig(model_name="m", worker_id="w", max_in_flight=2, commit_interval_s=3600),
        names=Names(),
        in_flight=in_flight,
        serving=serving,  # type: ignore[arg-type]
        outputs=None,  # type: ignore[arg-type]
        stopping=asyncio.Event(),
    )
    offset = 0
    for i in range(6):
        intake._hold(_record(offset := offset + 1, f"a{i}", "tenant-a", 64))
    for i in range(3):
        intake._hold(_record(offset := offset + 1, f"b{i}", "tenant-b", 8))
    assert intake.held_by_tier()["standard"] == 9
    assert intake._start_held() is True  # room for two; seven wait
    assert serving.started == ["a0", "b0"]  # level start, then B's turn: A was charged 64 + 8

    async def finish(rid: str) -> None:
        serving.finish[rid].set()
        await asyncio.sleep(0)  # the request's task ends, settling its charge
        await asyncio.sleep(0)
        intake._start_held()

    # Virtual times: A 72 (a0 charged 64 + 8), B 16 (b0 charged 8 + 8).
    await finish("b0")  # B settles to 9 used, then b1 (B 25 < A 72)
    assert intake.held.vtime("tenant-b") == 25
    await finish("a0")  # A settles to 65 used; b2 (B 41 < A 65)
    assert intake.held.vtime("tenant-a") == 65
    await finish("b1")  # B has nothing more held: a1
    await finish("b2")
    assert serving.started == ["a0", "b0", "b1", "b2", "a1", "a2"]
    # B's three started before A's third; in Kafka order they would have waited for all six of A's.
    assert serving.started.index("b2") < serving.started.index("a2")
    assert start_cost(InferenceRequest(request_id="x", model="m", prompt=[1, 2, 3], sampling={"max_tokens": 5})) == 8
    for task in in_flight.tasks():
        task.cancel()
    await asyncio.gather(*in_flight.tasks(), return_exceptions=True)
