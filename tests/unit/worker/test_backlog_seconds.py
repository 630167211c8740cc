"""The backlog-seconds estimate autoscaling reads: lag x expected tokens / measured tokens per second, with
tiers drained in order."""

from __future__ import annotations

import math

from gpu_workers.worker.backlog_seconds import GenerationRate, TokensPerRequest, backlog_seconds


def test_each_tier_waits_behind_the_tiers_above_it() -> None:
    seconds = backlog_seconds(
        {"interactive": 2, "standard": 4, "batch": 10},
        {"interactive": 50, "standard": 100, "batch": 200},
        tokens_per_second=100,
    )
    assert seconds == {"interactive": 1.0, "standard": 5.0, "batch": 25.0}


def test_no_backlog_is_zero_and_a_backlog_without_a_rate_is_infinite() -> None:
    assert backlog_seconds({}, {"interactive": 50}, 0.0) == {"interactive": 0.0, "standard": 0.0, "batch": 0.0}
    seconds = backlog_seconds({"standard": 1}, {"standard": 10}, 0.0)
    assert seconds["interactive"] == 0.0 and math.isinf(seconds["standard"]) and math.isinf(seconds["batch"])


def test_requests_that_fit_the_engines_free_seats_wait_behind_nothing() -> None:
    """They start at once beside the running ones, taken from the highest tier first: 16 arrivals on an engine
    with 48 free seats are no wait at all (admission once refused deadlines for about 1 s of such a burst,
    read as 6.8 s of queued generation)."""
    expected = {"interactive": 32, "standard": 32, "batch": 32}
    assert backlog_seconds({"standard": 16}, expected, 75.0, free_seats=48) == dict.fromkeys(
        ("interactive", "standard", "batch"), 0.0
    )
    seconds = backlog_seconds({"interactive": 2, "standard": 4, "batch": 10}, expected, 32.0, free_seats=3)
    # The 3 seats go to the 2 interactive and 1 standard request; 3 standard and 10 batch requests wait.
    assert seconds == {"interactive": 0.0, "standard": 3.0, "batch": 13.0}
    assert backlog_seconds({"batch": 5}, expected, 32.0, free_seats=-4)["batch"] == 5.0  # an overfull engine


def test_negative_lags_count_as_none() -> None:
    assert backlog_seconds({"interactive": -3, "batch": 1}, {"interactive": 9, "batch": 10}, 10)["batch"] == 1.0


def test_tokens_per_request_falls_back_from_tier_to_overall_to_default() -> None:
    expected = TokensPerRequest(default=256, weight=0.5)
    assert expected.expected("batch") == 256
    expected.observe("interactive", 100)
    assert expected.expected("batch") == 100  # overall mean until batch has its own
    expected.observe("interactive", 200)
    assert expected.expected("interactive") == 150
    expected.observe("batch", 40)
    assert expected.as_mapping() == {"interactive": 150, "standard": expected.expected("standard"), "batch": 40}


def test_generation_rate_counts_busy_intervals_only() -> None:
    rate = GenerationRate(weight=0.5)
    assert rate.sample(0.0, 0, busy=True) == 0.0  # the first sample only sets the baseline
    assert rate.sample(1.0, 100, busy=True) == 100.0
    assert rate.sample(2.0, 300, busy=True) == 150.0  # 200/s smoothed with weight 0.5
    assert rate.sample(10.0, 300, busy=False) == 150.0  # idle: the last rate stays
    assert rate.sample(11.0, 350, busy=True) == 100.0  # 50/s from the idle baseline
