"""``/v1/models``' card of a model says whether its workers run the deterministic mode, and warns when they mix."""

from __future__ import annotations

from ingress.routes.openai import _model_card
from schemas import WorkerHeartbeat


def _beat(worker: str, deterministic: bool, arithmetic: str | None = None) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        model="m",
        running=0,
        waiting=0,
        free_kv_blocks=1,
        total_kv_blocks=1,
        prefix_cache_hit_rate=0.0,
        deterministic=deterministic,
        arithmetic=arithmetic,
    )


def test_a_card_shows_the_mode_of_its_workers() -> None:
    on = _model_card("m", [_beat("a", True), _beat("b", True)])
    assert (on["deterministic"], on["deterministic_workers"], "warning" in on) == (True, 2, False)
    off = _model_card("m", [_beat("a", False)])
    assert (off["deterministic"], off["deterministic_workers"], "warning" in off) == (False, 0, False)


def test_a_fleet_that_mixes_modes_says_so() -> None:
    card = _model_card("m", [_beat("a", True), _beat("b", False), _beat("c", True)])
    assert card["deterministic"] is False
    assert card["deterministic_workers"] == 2
    assert "2 of 3 workers run deterministic" in card["warning"]


def test_an_older_worker_without_the_field_counts_as_not_deterministic() -> None:
    beat = WorkerHeartbeat.model_validate_json(_beat("a", True).model_dump_json(exclude={"deterministic"}))
    assert _model_card("m", [beat])["deterministic"] is False


def test_deterministic_workers_that_compute_differently_say_so() -> None:
    """Both in the mode, but one compiles its CPU steps and the other runs them eagerly: not the same bits."""
    compiled, eager = "cpu compiled steps, 1 threads, bfloat16", "cpu eager steps, 1 threads, bfloat16"
    card = _model_card("m", [_beat("a", True, compiled), _beat("b", True, eager), _beat("c", True, compiled)])
    assert card["deterministic"] is True
    assert "compute differently" in card["warning"] and compiled in card["warning"] and eager in card["warning"]
    alike = _model_card("m", [_beat("a", True, compiled), _beat("b", True, compiled), _beat("c", True)])
    assert "warning" not in alike  # a worker that does not say (an older one) is not counted against the rest
