"""What the worker holds is started by tier, then earliest deadline first; records without a deadline follow in
fetch order (one tenant; the engine's waiting queue keeps the same order). A record that does not parse goes first:
it only becomes a dead letter or an error, at no cost to anyone."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import InFlight
from gpu_workers.worker.intake import Intake
from schemas import TIERS, InferenceRequest, Names, utcnow


def _intake() -> Intake:
    # Ordering is arithmetic over the records: no consumer, engine or writer is reached.
    return Intake(
        consumer=None,  # type: ignore[arg-type]
        engine=None,  # type: ignore[arg-type]
        config=WorkerConfig(model_name="m", worker_id="w"),
        names=Names(),
        in_flight=InFlight(),
        serving=None,  # type: ignore[arg-type]
        outputs=None,  # type: ignore[arg-type]
        stopping=asyncio.Event(),
    )


_offsets = iter(range(1_000_000))


def _record(rid: str, tier: str, deadline_s: float | None) -> SimpleNamespace:
    deadline = None if deadline_s is None else utcnow() + timedelta(seconds=deadline_s)
    request = InferenceRequest(request_id=rid, model="m", prompt="hi", priority=tier, deadline=deadline)
    topic = Names().request_topic("m", tier)
    value = request.model_dump_json().encode()
    return SimpleNamespace(topic=topic, partition=0, offset=next(_offsets), value=value, headers=[])


def test_held_records_start_by_tier_then_earliest_deadline() -> None:
    records = [
        _record("s-plain", "standard", None),
        _record("b-soon", "batch", 1),
        _record("s-late", "standard", 60),
        SimpleNamespace(topic=Names().request_topic("m", "standard"), partition=0, offset=99, value=b"{", headers=[]),
        _record("s-soon", "standard", 5),
        _record("i-plain", "interactive", None),
        _record("s-plain-2", "standard", None),
    ]
    intake = _intake()
    for record in records:
        intake._hold(record)
    assert intake.held_by_tier() == {"interactive": 1, "standard": 5, "batch": 1}
    order = []
    for tier in TIERS:
        while (held := intake.held.pop(tier)) is not None:
            parsed = held.item[1]
            order.append(parsed.request_id if isinstance(parsed, InferenceRequest) else "bad")
    assert order == ["i-plain", "bad", "s-soon", "s-late", "s-plain", "s-plain-2", "b-soon"]
