"""The nemesis's fault schedule: every kind in turn, workers in turn, spaced so one fault ends before the next."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from benchmarks.nemesis_faults import FAULT_KINDS, schedule

HOLDS = {"kill": 3.0, "pause": 10.0, "partition_kafka": 12.0, "partition_redis": 10.0}


def test_ten_minutes_at_thirty_seconds_gives_five_faults_of_each_kind_one_worker_at_a_time() -> None:
    faults = schedule(600, ["w0", "w1", "w2"], 30, HOLDS, first_s=10)
    assert Counter(f.kind for f in faults) == dict.fromkeys(FAULT_KINDS, 5)
    assert all(b.at_s - a.at_s == 30 for a, b in itertools.pairwise(faults))
    assert all(a.worker != b.worker for a, b in itertools.pairwise(faults))
    assert all(f.at_s + f.hold_s < 600 and f.hold_s == HOLDS[f.kind] for f in faults)


def test_a_spacing_shorter_than_a_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="must exceed the longest hold"):
        schedule(600, ["w0"], 12, HOLDS)
