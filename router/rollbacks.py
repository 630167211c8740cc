"""Canary rollbacks shared through Redis, so every process that routes (each ingress replica, the router for
Kafka-native requests, the batch worker for batch lines) stops sending traffic to a rolled-back canary, and a
restarted one does not forget.

A rollback is recorded under ``Names.route_rollback_key(route, version)`` with the digest of the route as it
was written; it applies to that spec only, so editing the route in the file (an operator's decision) clears it
everywhere. Deciding a rollback is ingress's (``router.canary`` judges what ingress watches); this module
only stores, reads and applies the verdicts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Mapping

from redis.asyncio import Redis

from schemas import Names

from .canary import Rollback
from .routes import RoutesFile, RouteSpec

# A rollback outlives any sensible canary window; an operator edits the route long before this.
ROLLBACK_TTL_S = 7 * 24 * 3600

RolledBack = set[tuple[str, str]]  # (route, version)


def spec_digest(spec: RouteSpec) -> str:
    """A short digest of a route as written: a rollback recorded under it applies to this spec only."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


def live_weights(route: str, spec: RouteSpec, rolled_back: RolledBack) -> dict[str, float]:
    """The route's live weights: the file's, with rolled-back canaries at 0 (and the stable versions sharing
    evenly should nothing else be left)."""
    live = {t.model: 0.0 if (route, t.model) in rolled_back else t.weight for t in spec.targets}
    if not any(w > 0 for w in live.values()):
        live = {t.model: 0.0 if t.canary else 1.0 for t in spec.targets}
    return live


def still_standing(rolled_back: RolledBack, old: Mapping[str, RouteSpec], new: Mapping[str, RouteSpec]) -> RolledBack:
    """The rollbacks that survive a reload: those of routes whose spec did not change."""
    return {(r, v) for r, v in rolled_back if r in new and old.get(r) == new[r]}


async def share_rollback(redis: Redis, names: Names, verdict: Rollback, spec: RouteSpec) -> None:
    """Record a rollback for the other processes (Redis errors are the caller's to log)."""
    record = {"spec": spec_digest(spec), "cause": verdict.cause, "at": time.time()}
    key = names.route_rollback_key(verdict.route, verdict.version)
    await redis.set(key, json.dumps(record), ex=ROLLBACK_TTL_S)


async def read_rollbacks(redis: Redis, names: Names, routes: RoutesFile, known: RolledBack) -> RolledBack:
    """The rollbacks recorded for the routes as they are now written, beyond ``known`` (one MGET; none asked
    when no canary is left to roll back)."""
    wanted = [
        (route, t.model, spec_digest(spec))
        for route, spec in routes.routes.items()
        for t in spec.targets
        if t.canary and (route, t.model) not in known
    ]
    if not wanted:
        return set()
    raw = await redis.mget([names.route_rollback_key(r, v) for r, v, _ in wanted])
    found: RolledBack = set()
    for (route, version, digest), value in zip(wanted, raw, strict=True):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            if value is not None and json.loads(value)["spec"] == digest:
                found.add((route, version))
    return found
