"""Completion watermarks never let a commit pass an unfinished request."""

import random

import pytest

from gpu_workers.worker.offsets import CompletionWatermarks


def test_out_of_order_completion_holds_the_watermark() -> None:
    marks: CompletionWatermarks[str] = CompletionWatermarks()
    for off in (10, 11, 12):
        marks.started("p0", off)
    assert marks.watermark("p0") == 10
    marks.finished("p0", 12)
    marks.finished("p0", 11)
    assert marks.watermark("p0") == 10  # 10 still running: committing 11+ could lose it
    marks.finished("p0", 10)
    assert marks.watermark("p0") == 13


def test_to_commit_reports_only_moves() -> None:
    marks: CompletionWatermarks[str] = CompletionWatermarks()
    marks.started("a", 0)
    marks.started("b", 5)
    assert marks.to_commit() == {"a": 0, "b": 5}
    marks.mark_committed({"a": 0, "b": 5})
    assert marks.to_commit() == {}
    marks.finished("a", 0)
    assert marks.to_commit() == {"a": 1}


def test_unknown_offset_is_an_error() -> None:
    marks: CompletionWatermarks[str] = CompletionWatermarks()
    with pytest.raises(KeyError):
        marks.finished("p", 3)


def test_random_interleavings_match_a_brute_force_model() -> None:
    rng = random.Random(7)
    marks: CompletionWatermarks[int] = CompletionWatermarks()
    running: set[int] = set()
    seen = -1
    for off in range(300):
        marks.started(0, off)
        running.add(off)
        seen = off
        while running and rng.random() < 0.6:
            done = rng.choice(sorted(running))
            running.remove(done)
            marks.finished(0, done)
        expected = min(running) if running else seen + 1
        assert marks.watermark(0) == expected


def test_holds_says_whether_an_offset_is_started_and_unfinished() -> None:
    marks: CompletionWatermarks[str] = CompletionWatermarks()
    assert not marks.holds("p", 3)
    marks.started("p", 3)
    assert marks.holds("p", 3) and not marks.holds("p", 4) and not marks.holds("q", 3)
    marks.finished("p", 3)
    assert not marks.holds("p", 3)
