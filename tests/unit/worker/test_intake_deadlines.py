"""What one fetch brings is admitted by tier, then earliest deadline first; records without a deadline, and those
that do not parse, follow in fetch order (the engine's waiting queue keeps the same order)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace

from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.in_flight import InFlight
from gpu_workers.worker.intake import Intake
from schemas import InferenceRequest, Names, utcnow


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


def _record(rid: str, tier: str, deadline_s: float | None) -> SimpleNamespace:
    deadline = None if deadline_s is None else utcnow() + timedelta(seconds=deadline_s)
    request = InferenceRequest(request_id=rid, model="m", prompt="hi", priority=tier, deadline=deadline)
    topic = Names().request_topic("m", tier)
    return SimpleNamespace(topic=topic, partition=0, offset=0, value=request.model_dump_json().encode(), headers=[])


def test_fetched_records_are_admitted_by_tier_then_earliest_deadline() -> None:
    records = [
        _record("s-plain", "standard", None),
        _record("b-soon", "batch", 1),
        _record("s-late", "standard", 60),
        SimpleNamespace(topic=Names().request_topic("m", "standard"), partition=0, offset=0, value=b"{", headers=[]),
        _record("s-soon", "standard", 5),
        _record("i-plain", "interactive", None),
        _record("s-plain-2", "standard", None),
    ]
    order = [
        parsed.request_id if isinstance(parsed, InferenceRequest) else "bad"
        for _, parsed in _intake()._by_deadline(records)
    ]
    assert order == ["i-plain", "s-soon", "s-late", "s-plain", "bad", "s-plain-2", "b-soon"]
