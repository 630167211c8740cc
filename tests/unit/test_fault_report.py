"""tests/fault_report.py: the FAULT-REPORT line's losses and duplicates are counted, never assumed."""

from __future__ import annotations

import json

import pytest
from fault_report import Delivery, count_events, count_text, fault_report


def test_a_complete_stream_received_once_counts_zero() -> None:
    assert count_events({"a": [0, 1, 2, 3]}, {"a": 3}) == Delivery(0, 0)


def test_gaps_missing_tails_repeats_and_unread_requests_are_counted() -> None:
    received = {"a": [0, 1, 1, 3, 4], "b": [0, 1]}
    # a: seq 2 lost, seq 1 twice; b: 2..5 never arrived; c: nothing received of its 0..2.
    assert count_events(received, {"a": 4, "b": 5, "c": 2}) == Delivery(losses=1 + 4 + 3, duplicates=1)


def test_text_is_counted_in_characters() -> None:
    assert count_text("hello world", "hello world") == Delivery(0, 0)
    assert count_text("hello wld", "hello world") == Delivery(2, 0)
    assert count_text("hello wo world", "hello world") == Delivery(0, 3)


def test_the_report_prints_the_counted_figures(capsys: pytest.CaptureFixture[str]) -> None:
    fault_report("one", Delivery(2, 1), requests=3)
    fault_report("two", {"websocket": Delivery(0, 0), "sse": Delivery(5, 0)})
    lines = [json.loads(line.removeprefix("FAULT-REPORT ")) for line in capsys.readouterr().out.split("\n") if line]
    assert lines == [
        {"test": "one", "requests": 3, "losses": 2, "duplicates": 1},
        {"test": "two", "losses": {"websocket": 0, "sse": 5}, "duplicates": {"websocket": 0, "sse": 0}},
    ]
