"""The paired transport run's option parsing and its comparison table (the secure - plain difference and the
target's verdict at 10 requests/s)."""

from __future__ import annotations

import pytest

from benchmarks.pipeline_load import Sample
from benchmarks.pipeline_report import Level, analyse
from benchmarks.pipeline_transports import parse_transports, transport_table


def test_transports_are_one_or_both_each_once() -> None:
    assert parse_transports("plain") == ["plain"]
    assert parse_transports(" secure , plain") == ["secure", "plain"]
    for bad in ("", "tls", "plain,plain", "plain,secure,tls"):
        with pytest.raises(ValueError, match="expected one or both of plain, secure"):
            parse_transports(bad)


def _level(rate: float, overheads_ms: list[float]) -> Level:
    """A level whose requests each had an engine TTFT of 2 ms and the given overhead."""
    samples, stamps = [], {}
    for i, overhead in enumerate(overheads_ms):
        rid = f"r{i}"
        samples.append(Sample(sent=100.0, accepted=100.001, first=100.002 + overhead / 1000, request_id=rid))
        stamps[rid] = {"arrival": 100.0005, "first_token": 100.0025}
    level = Level(rate, 1.0, samples)
    analyse(level, stamps)
    return level


def test_the_difference_is_secure_minus_plain_and_judged_at_10_per_second() -> None:
    plain, secure = _level(10, [3.0, 3.0, 3.0]), _level(10, [3.5, 3.5, 3.5])
    lines = transport_table([("plain", plain), ("secure", secure)]).splitlines()
    diff = next(line for line in lines if "secure - plain" in line)
    assert "+0.50" in diff and "met" in diff
    slow = _level(10, [5.0, 5.0, 5.0])
    diff = next(line for line in transport_table([("plain", plain), ("secure", slow)]).splitlines() if " - " in line)
    assert "+2.00" in diff and "missed" in diff
    # Another rate is compared but not judged.
    other = transport_table([("plain", _level(50, [3.0])), ("secure", _level(50, [9.0]))])
    assert "+6.00" in other and "met" not in other and "missed" not in other
