"""When a deadline cannot be met: the smallest backlog at or above the request's tier that a live, not draining
worker reports, against the time left; no deadline or no estimate never refuses."""

from __future__ import annotations

from datetime import timedelta

from router.policy import deadline_unmeetable, expected_start_s
from schemas import InferenceRequest, Tier, WorkerHeartbeat, utcnow


def _beat(worker: str, backlog: dict[Tier, float] | None, draining: bool = False) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker, model="m", running=0, waiting=0, free_kv_blocks=1, total_kv_blocks=1,
        prefix_cache_hit_rate=0.0, draining=draining, backlog_seconds=backlog,
    )  # fmt: skip


def test_the_least_loaded_live_worker_decides() -> None:
    beats = [_beat("a", {"standard": 50.0}), _beat("b", {"standard": 20.0}), _beat("c", {"standard": 1.0}, True)]
    assert expected_start_s("standard", beats) == 20.0
    assert expected_start_s("interactive", beats) is None
    assert expected_start_s("standard", [_beat("d", None)]) is None


def test_a_deadline_sooner_than_the_backlog_is_unmeetable() -> None:
    now = utcnow()
    beats = [_beat("a", {"standard": 20.0})]

    def request(seconds: float | None) -> InferenceRequest:
        deadline = None if seconds is None else now + timedelta(seconds=seconds)
        return InferenceRequest(request_id="r", model="m", prompt="x", deadline=deadline)

    why = deadline_unmeetable(request(10), "standard", beats, now)
    assert why is not None and "20.0 s of work queued" in why and "10.0 s away" in why
    assert deadline_unmeetable(request(30), "standard", beats, now) is None
    assert deadline_unmeetable(request(None), "standard", beats, now) is None
    assert deadline_unmeetable(request(10), "interactive", beats, now) is None  # nothing known there
