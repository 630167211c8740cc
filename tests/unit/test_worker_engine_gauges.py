"""The worker's engine gauges: running and waiting requests per model and tier, from the engine's counts per
priority (the tier's rank), every tier present so ``sum by (model)`` and per-tier panels both read."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_workers.engine.outputs import EngineStats
from gpu_workers.worker.telemetry import WorkerTelemetry


class _Engine:
    """Only what WorkerTelemetry reads of an engine."""

    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def add_delta_observer(self, observer: object) -> None:
        pass

    def stats(self) -> EngineStats:
        return self._stats


def _samples(stats: EngineStats) -> dict[tuple[str, str], float]:
    telemetry = WorkerTelemetry(_Engine(stats), "m", "w")  # type: ignore[arg-type]
    text = generate_latest(telemetry.registry).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("sluicegate:num_requests_running", "sluicegate:num_requests_waiting"):
            for sample in family.samples:
                assert sample.labels["model"] == "m"
                found[(family.name.split("_")[-1], sample.labels["tier"])] = sample.value
    return found


def test_running_and_waiting_are_labelled_by_tier() -> None:
    stats = EngineStats(3, 4, 10, 40, 0.0, 0, 0, 0, running_by_priority={0: 2, 2: 1}, waiting_by_priority={1: 4})
    assert _samples(stats) == {
        ("running", "interactive"): 2,
        ("running", "standard"): 0,
        ("running", "batch"): 1,
        ("waiting", "interactive"): 0,
        ("waiting", "standard"): 4,
        ("waiting", "batch"): 0,
    }


def test_an_idle_engine_shows_zero_for_every_tier() -> None:
    assert set(_samples(EngineStats(0, 0, 40, 40, 0.0, 0, 0, 0)).values()) == {0}
