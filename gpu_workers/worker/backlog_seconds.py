"""The backlog estimate in seconds that autoscaling reads: how long the requests waiting in Kafka at or above a
tier would take this worker to generate, from its consumer lag, the tokens a request of each tier is expected to
generate and the generation rate it has measured.

Pure arithmetic and two small trackers, kept apart from the metrics they feed so they can be tested alone.

Why per worker, not per consumer group: a record waits on its partition, and its partition on one worker, so
what a request will wait is its worker's backlog, and ``max by (model, tier)`` of the per-worker gauge is the
worst wait in the group: what the deadline alert and KEDA's scale-out trigger want. The group-wide figure
(all queued tokens over the group's summed rate: what the group would need were the work spread evenly) is a
query over the same gauges, backlog x rate summed over workers / the summed rate (the dashboard's "group
backlog" line), so no worker has to read the other workers' partitions or rates to export it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from schemas import TIERS, Tier, tier_rank


def backlog_seconds(
    lags: Mapping[str, int],
    tokens_per_request: Mapping[str, float],
    tokens_per_second: float,
    free_seats: int = 0,
) -> dict[Tier, float]:
    """Seconds of generation queued at or above each tier (the worker drains tiers in order, so a batch
    request waits behind the interactive and standard backlog too).

    ``lags``: requests not yet taken per tier; ``tokens_per_request``: expected generated tokens of one request
    of the tier; ``tokens_per_second``: the measured generation rate; ``free_seats``: sequences the engine could
    still add to its batch. Requests that fill those seats start at once, beside the running ones, so they wait
    behind nothing: they come off the highest tiers first and add no seconds (16 requests arriving together on an
    engine of 64 seats read as 6.8 s of wait, and admission refused deadlines the requests would have met). No
    backlog is 0 s; a backlog with no measured rate is infinite (nothing says it will ever drain).
    """
    waiting: dict[str, int] = {}
    seats = max(0, free_seats)
    for each in TIERS:
        count = max(0, lags.get(each, 0))
        seated = min(seats, count)
        seats -= seated
        waiting[each] = count - seated
    seconds: dict[Tier, float] = {}
    for tier in TIERS:
        tokens = sum(
            waiting[each] * max(0.0, tokens_per_request.get(each, 0.0))
            for each in TIERS
            if tier_rank(each) <= tier_rank(tier)
        )
        if tokens <= 0:
            seconds[tier] = 0.0
        elif tokens_per_second <= 0:
            seconds[tier] = math.inf
        else:
            seconds[tier] = tokens / tokens_per_second
    return seconds


class TokensPerRequest:
    """Exponentially weighted mean of the tokens a finished request generated, per tier; a tier with no
    history yet borrows the mean over all tiers, then ``default``."""

    def __init__(self, default: float, weight: float = 0.1) -> None:
        self.default = default
        self.weight = weight
        self._mean: dict[str, float] = {}
        self._overall: float | None = None

    def observe(self, tier: str, tokens: int) -> None:
        previous = self._mean.get(tier)
        self._mean[tier] = tokens if previous is None else previous + self.weight * (tokens - previous)
        overall = self._overall
        self._overall = tokens if overall is None else overall + self.weight * (tokens - overall)

    def expected(self, tier: str) -> float:
        mean = self._mean.get(tier)
        if mean is not None:
            return mean
        return self._overall if self._overall is not None else self.default

    def as_mapping(self) -> dict[str, float]:
        return {tier: self.expected(tier) for tier in TIERS}


class GenerationRate:
    """Generated tokens per second, measured between samples of a cumulative token count and smoothed.

    Only intervals in which the engine was busy count: an idle worker keeps the rate it last showed instead of
    dropping to zero (which would make any new backlog look infinite).
    """

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.rate = 0.0
        self._last: tuple[float, int] | None = None

    def sample(self, now: float, total_tokens: int, busy: bool) -> float:
        last, self._last = self._last, (now, total_tokens)
        if last is None or not busy:
            return self.rate
        elapsed, made = now - last[0], total_tokens - last[1]
        if elapsed <= 0 or made < 0:
            return self.rate
        measured = made / elapsed
        self.rate = measured if self.rate <= 0 else self.rate + self.weight * (measured - self.rate)
        return self.rate
