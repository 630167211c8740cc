"""Judging canaries: each routed version's recent outcomes (succeeded or not, time to first token) over a
sliding window, and the verdict that a canary is worse than the route's stable versions by more than its
policy's margins, which rolls it back to weight 0.

Pure bookkeeping with an injected clock: the caller records outcomes, asks for verdicts and applies them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .routes import CanaryPolicy, RouteSpec


@dataclass(frozen=True)
class Outcome:
    at: float
    ok: bool
    ttft_s: float | None


@dataclass(frozen=True)
class WindowStats:
    requests: int
    error_rate: float
    ttft_p99_s: float | None

    def line(self) -> str:
        p99 = "n/a" if self.ttft_p99_s is None else f"{self.ttft_p99_s:.3f}s"
        return f"requests={self.requests} error_rate={self.error_rate:.3f} ttft_p99={p99}"


@dataclass(frozen=True)
class Rollback:
    """A canary to set to weight 0, why, and the figures that decided it (for the log)."""

    route: str
    version: str
    cause: str
    canary: WindowStats
    stable: WindowStats


def p99(values: list[float]) -> float | None:
    """The 99th percentile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass
class CanaryJudge:
    """Outcomes per (route, version) within the longest window any policy asks for."""

    _outcomes: dict[tuple[str, str], deque[Outcome]] = field(default_factory=dict)

    def record(self, route: str, version: str, outcome: Outcome) -> None:
        self._outcomes.setdefault((route, version), deque(maxlen=10_000)).append(outcome)

    def stats(self, route: str, versions: list[str], *, since: float) -> WindowStats:
        """The pooled outcomes of ``versions`` at or after ``since``."""
        window = [o for v in versions for o in self._outcomes.get((route, v), ()) if o.at >= since]
        errors = sum(not o.ok for o in window)
        ttfts = [o.ttft_s for o in window if o.ok and o.ttft_s is not None]
        return WindowStats(len(window), errors / len(window) if window else 0.0, p99(ttfts))

    def verdicts(self, route: str, spec: RouteSpec, weights: dict[str, float], *, now: float) -> list[Rollback]:
        """Canaries of ``route`` still above weight 0 that its policy says to roll back now."""
        policy = spec.canary or CanaryPolicy()
        since = now - policy.window_s
        stable = self.stats(route, [t.model for t in spec.targets if not t.canary], since=since)
        out = []
        for target in spec.targets:
            if not target.canary or weights.get(target.model, 0) <= 0:
                continue
            canary = self.stats(route, [target.model], since=since)
            if canary.requests < policy.min_requests:
                continue
            if canary.error_rate > stable.error_rate + policy.error_rate_margin:
                out.append(Rollback(route, target.model, "error_rate", canary, stable))
            elif (
                canary.ttft_p99_s is not None
                and stable.ttft_p99_s is not None
                and stable.requests >= policy.min_requests
                and canary.ttft_p99_s > stable.ttft_p99_s * (1 + policy.ttft_p99_margin)
            ):
                out.append(Rollback(route, target.model, "ttft_p99", canary, stable))
        return out

    def forget(self, route: str) -> None:
        """Drop a route's outcomes (its spec changed: the old figures judged other weights)."""
        for key in [k for k in self._outcomes if k[0] == route]:
            del self._outcomes[key]
