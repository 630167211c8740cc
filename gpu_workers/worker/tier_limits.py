"""How many requests each tier may take from Kafka now, so batch work yields to interactive traffic.

- Every tier: ``max_in_flight`` counted per tier and above (batch work never keeps an interactive request out).
- While a more important tier is *busy* (held now, or taken within ``busy_window_s``), the tiers below hold at
  most ``lower_tier_in_flight_while_busy`` requests in all.
- While a more important tier is busy, the batch tier starts at most ``batch_rate_while_busy`` requests a
  second, evenly spaced. On shared CPU cores a batch line costs the whole path (Kafka, the worker's loop, Redis,
  the result, the collector) a few milliseconds of CPU, and at hundreds of lines a second that CPU is what an
  interactive request queues behind; the in-flight cap alone does not bound it, since short lines finish and are
  replaced at once. The window matters because interactive traffic arrives in gaps: without it, the batch would
  run at full speed in every gap and be mid-burst when the next interactive request lands.
- With the pace on, no batch request starts while a more important one waits for its first token (for at most
  ``_FIRST_TOKEN_HOLD_S``, so a stuck request never starves the batch): a start (parsing, the chat template, the
  pickup read, the prefill) is the costliest part of a batch line, and that wait is the TTFT being made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from schemas import TIERS
from schemas.names import Tier

from .config import WorkerConfig

_BATCH: Tier = TIERS[-1]

#: How long a more important request waiting for its first token holds batch starts back, at most.
_FIRST_TOKEN_HOLD_S = 0.5
#: How often the intake looks again while batch starts are held for a first token.
_FIRST_TOKEN_POLL_S = 0.005


class TierLimits:
    """Each tier's room, from what the worker holds and what it took lately."""

    def __init__(self, config: WorkerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._last_taken: dict[Tier, float] = {}
        self._next_batch_at = float("-inf")
        self._holding = False  # batch starts held for a first token (as of the last ``rooms``)

    def taken(self, tier: Tier) -> None:
        """A record of ``tier`` was taken: it makes the tiers below yield, and spends the batch tier's pace."""
        now = self._clock()
        self._last_taken[tier] = now
        if tier == _BATCH:
            # Spaced from the last start; :meth:`rooms` enforces it only while the batch tier is paced.
            self._next_batch_at = now + self._pace_s

    def rooms(
        self, held: Mapping[Tier, int], awaiting_first_token: Sequence[tuple[Tier, float]] = ()
    ) -> dict[Tier, int]:
        """How many more requests each tier may take now (0 or less: none); ``awaiting_first_token``: the tier of
        each held request that has no first token yet, and when it was taken."""
        now = self._clock()
        self._holding = bool(self._pace_s) and any(
            tier != _BATCH and now - taken < _FIRST_TOKEN_HOLD_S for tier, taken in awaiting_first_token
        )
        config = self.config
        rooms: dict[Tier, int] = {}
        at_or_above = 0
        total = sum(held.values())
        for tier in TIERS:
            rooms[tier] = config.max_in_flight - at_or_above - held.get(tier, 0)
            if self._busy_above(tier, held, now):
                if config.lower_tier_in_flight_while_busy:
                    # This tier and those below may hold only the busy cap in all.
                    rooms[tier] = min(rooms[tier], config.lower_tier_in_flight_while_busy - (total - at_or_above))
                if tier == _BATCH and self._pace_s:
                    rooms[tier] = min(rooms[tier], 0 if self._holding or now < self._next_batch_at else 1)
            at_or_above += held.get(tier, 0)
        return rooms

    def paced_wait_s(self) -> float | None:
        """Seconds until the batch tier may start its next request, when its pace (or a first token awaited)
        holds it back now; None when neither does."""
        if not self._pace_s:
            return None
        wait = self._next_batch_at - self._clock()
        if self._holding:
            return max(wait, _FIRST_TOKEN_POLL_S)
        return wait if wait > 0 else None

    @property
    def _pace_s(self) -> float:
        rate = self.config.batch_rate_while_busy
        return 1.0 / rate if rate > 0 else 0.0

    def _busy_above(self, tier: Tier, held: Mapping[Tier, int], now: float) -> bool:
        """Whether a tier more important than ``tier`` is held, or was taken within the busy window."""
        for above in TIERS[: TIERS.index(tier)]:
            if held.get(above, 0):
                return True
            last = self._last_taken.get(above)
            if last is not None and now - last < self.config.busy_window_s:
                return True
        return False
