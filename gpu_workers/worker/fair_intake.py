"""Which fetched record a worker starts next: earliest deadline first, then tenants by tokens (virtual time).

The worker fetches records ahead of what it starts (:mod:`.intake`) and holds them here, one queue per tier. Inside
a tier, a record with a deadline starts before every record without one, earliest first (as in the engine's
waiting queue); the rest start by start-time fair queuing over tenants, the engine's scheme one level up: each
tenant with records held or started and not finished has a virtual time, advanced at each start by the record's
cost (its prompt tokens plus ``max_tokens``, an estimate) over the tenant's weight and settled to the tokens it
really used when it finishes; the next start goes to the tenant with the smallest virtual time (its earliest
record). A tenant that joins starts at the smallest virtual time of the others, so idling earns no credit.

Why tokens and not records: Kafka hands a partition's records over in order, so a worker that starts records as
they come serves the tenants in requests, and one sending prompts 8x longer gets 8x the tokens. Charged by
tokens, the tenant of short prompts has its records started 8x as often while both have records held.

Nothing here does I/O or imports the pipeline: the intake and the fairness benchmark drive the same class.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
K = Hashable  # a tier


@dataclass
class Held(Generic[T]):
    """One record held: what the caller stores, whose it is, what its start is charged, and when it must start."""

    item: T
    tenant: str
    cost: int
    deadline: float | None
    order: int = 0  # arrival, ties go to the earliest
    charged: int = 0  # what its start added to the tenant's virtual time (x weight), settled at the finish


@dataclass
class _Share:
    weight: float
    vtime: float
    live: int = 0  # records held or started, not finished


@dataclass
class _TierQueue(Generic[T]):
    deadlined: list[tuple[float, int, Held[T]]] = field(default_factory=list)  # heap by (deadline, order)
    by_tenant: dict[str, deque[Held[T]]] = field(default_factory=dict)
    size: int = 0


class FairIntake(Generic[T]):
    """Held records per tier, started deadline first, then by tenant virtual time charged in tokens."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self._shares: dict[str, _Share] = {}
        self._tiers: dict[K, _TierQueue[T]] = {}
        self._order = itertools.count()

    # --- holding -------------------------------------------------------------------------------------------------
    def push(self, tier: K, item: T, tenant: str, cost: int, deadline: float | None = None) -> None:
        """Hold ``item`` of ``tenant``; its start will be charged ``cost`` tokens."""
        share = self._shares.get(tenant)
        if share is None:
            start = min((s.vtime for s in self._shares.values()), default=0.0)
            share = self._shares[tenant] = _Share(self._weights.get(tenant, 1.0), start)
        share.live += 1
        held = Held(item, tenant, max(0, cost), deadline, next(self._order))
        queue = self._tiers.setdefault(tier, _TierQueue())
        queue.size += 1
        if deadline is not None:
            heapq.heappush(queue.deadlined, (deadline, held.order, held))
        else:
            queue.by_tenant.setdefault(tenant, deque()).append(held)

    def held(self, tier: K) -> int:
        """Records of ``tier`` held, not started."""
        queue = self._tiers.get(tier)
        return queue.size if queue else 0

    def __len__(self) -> int:
        return sum(q.size for q in self._tiers.values())

    def __iter__(self) -> Iterator[Held[T]]:
        for queue in self._tiers.values():
            yield from (held for _, _, held in queue.deadlined)
            for records in queue.by_tenant.values():
                yield from records

    # --- starting ------------------------------------------------------------------------------------------------
    def pop(self, tier: K) -> Held[T] | None:
        """The next record of ``tier`` to start (its tenant charged its cost), or None when none is held."""
        queue = self._tiers.get(tier)
        if not queue or not queue.size:
            return None
        if queue.deadlined:
            held = heapq.heappop(queue.deadlined)[2]
        else:
            tenant = min(queue.by_tenant, key=lambda t: (self._shares[t].vtime, queue.by_tenant[t][0].order))
            records = queue.by_tenant[tenant]
            held = records.popleft()
            if not records:
                del queue.by_tenant[tenant]
        queue.size -= 1
        held.charged = held.cost if self._charge(held.tenant, held.cost) else 0
        return held

    def settle(self, held: Held[T], used: int | None = None) -> None:
        """A started record finished: charge its tenant the tokens it ``used`` (when known) in place of the
        estimate its start was charged, and forget the tenant once nothing of it is held or running."""
        if used is not None and held.charged:
            self._charge(held.tenant, max(0, used) - held.charged)
        self._release(held.tenant)

    def drop(self, keep: Callable[[T], bool]) -> list[T]:
        """Stop holding every record for which ``keep`` is false (their partition moved away); they are returned."""
        dropped: list[T] = []
        for queue in self._tiers.values():
            kept = []
            for entry in queue.deadlined:
                if keep(entry[2].item):
                    kept.append(entry)
                else:
                    dropped.append(entry[2].item)
                    self._release(entry[2].tenant)
            heapq.heapify(kept)
            queue.deadlined = kept
            for tenant in list(queue.by_tenant):
                records = queue.by_tenant[tenant]
                gone = [held for held in records if not keep(held.item)]
                if not gone:
                    continue
                dropped += [held.item for held in gone]
                for _ in gone:
                    self._release(tenant)
                left = deque(held for held in records if keep(held.item))
                if left:
                    queue.by_tenant[tenant] = left
                else:
                    del queue.by_tenant[tenant]
            queue.size = len(queue.deadlined) + sum(len(r) for r in queue.by_tenant.values())
        return dropped

    def vtime(self, tenant: str) -> float | None:
        """``tenant``'s virtual time, None when it holds and runs nothing (for tests and metrics)."""
        share = self._shares.get(tenant)
        return None if share is None else share.vtime

    # --- accounting ----------------------------------------------------------------------------------------------
    def _charge(self, tenant: str, tokens: int) -> bool:
        """Advance ``tenant``'s virtual time by ``tokens`` (negative: taken back); False when nothing was kept."""
        # Only differences between tenants matter, and a joining tenant starts at the others' minimum, so with a
        # single tenant live there is nothing to keep (as in the engine's scheduler).
        share = self._shares.get(tenant)
        if share is None or len(self._shares) < 2:
            return False
        share.vtime += tokens / share.weight
        return True

    def _release(self, tenant: str) -> None:
        share = self._shares.get(tenant)
        if share is None:
            return
        share.live -= 1
        if share.live <= 0:
            del self._shares[tenant]
