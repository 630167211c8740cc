"""Which tenants the router has lately sent the most tokens to each worker, so an overloaded worker sheds the heavy
tenant's requests and keeps the others'.

Prefix affinity sends every request sharing a preamble to one worker; a tenant with a backlog of long prompts
behind one system prompt overloads that worker, and the overload rule then diverted every request keyed to it,
whoever sent it. With ``TenantShares`` the router charges each routed request's tokens (prompt estimate plus
``max_tokens`` per choice, as the worker's intake charges a start) to the worker that owns its partition and its
tenant, with exponential decay (``half_life_s``). When the owner is overloaded, a tenant at or under an equal share
of that worker's recent tokens keeps its affinity (its prefix-cache hits, and the owner's intake starts it fairly by
tokens ahead of the heavy tenant's held backlog); a tenant above it is the one diverted to the relief worker, so its
backlog spreads instead of queueing ahead of everyone on the owner.

Each router process (every ingress and the Kafka-native router) keeps its own view of what it routed; with several,
each sees a sample of the traffic, which is enough to tell a heavy tenant from a light one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class _Worker:
    """One worker's decayed token totals by tenant, as of ``stamp``."""

    tokens: dict[str, float] = field(default_factory=dict)
    stamp: float = 0.0


class TenantShares:
    """Decayed tokens routed per (worker, tenant); see the module docstring."""

    def __init__(self, half_life_s: float = 30.0, max_tenants_per_worker: int = 4096) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._rate = math.log(2) / half_life_s
        self._max_tenants = max_tenants_per_worker
        self._workers: dict[str, _Worker] = {}

    def _decayed(self, worker_id: str, now: float) -> _Worker:
        worker = self._workers.setdefault(worker_id, _Worker(stamp=now))
        if now > worker.stamp:
            factor = math.exp(-self._rate * (now - worker.stamp))
            # Tenants whose share decayed to almost nothing are forgotten: the table stays as small as the traffic.
            worker.tokens = {t: v * factor for t, v in worker.tokens.items() if v * factor >= 1.0}
            worker.stamp = now
        return worker

    def charge(self, worker_id: str, tenant: str, tokens: int, now: float | None = None) -> None:
        """Count ``tokens`` routed to ``worker_id`` for ``tenant``."""
        worker = self._decayed(worker_id, time.monotonic() if now is None else now)
        if tenant not in worker.tokens and len(worker.tokens) >= self._max_tenants:
            # A bounded table: the lightest tenant makes room (it is the one whose share matters least).
            del worker.tokens[min(worker.tokens, key=worker.tokens.__getitem__)]
        worker.tokens[tenant] = worker.tokens.get(tenant, 0.0) + max(0, tokens)

    def over_share(self, worker_id: str, tenant: str, now: float | None = None) -> bool:
        """Whether ``tenant`` took more than an equal share of ``worker_id``'s recent tokens.

        A worker that only one tenant (or none) used lately has no one to protect: True, so the overload rule
        diverts as it always did.
        """
        worker = self._decayed(worker_id, time.monotonic() if now is None else now)
        if len(worker.tokens) < 2:
            return True
        total = sum(worker.tokens.values())
        return worker.tokens.get(tenant, 0.0) > total / len(worker.tokens)
