"""Workers' latest heartbeats as mirrored in Redis, read with a short cache so routing and model
listing cost at most one Redis round trip per model per refresh interval.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import ValidationError
from redis.asyncio import Redis

from schemas import Names, WorkerHeartbeat
from sluicegate.telemetry import untraced

from .policy import live_heartbeats

log = logging.getLogger(__name__)


async def read_heartbeats(redis: Redis, names: Names, model: str, *, max_age_s: float) -> list[WorkerHeartbeat]:
    """The live heartbeats in ``Names.workers_key(model)``; malformed entries are logged and skipped."""
    raw = await redis.hgetall(names.workers_key(model))
    beats: list[WorkerHeartbeat] = []
    for field, value in raw.items():
        try:
            beats.append(WorkerHeartbeat.model_validate_json(value))
        except ValidationError as exc:
            log.warning("router.bad_heartbeat model=%s worker=%r error=%s", model, field, exc.errors()[:1])
    return [b for b in live_heartbeats(beats, max_age_s=max_age_s) if b.model == model]


async def read_live_models(redis: Redis, names: Names, *, max_age_s: float) -> dict[str, list[WorkerHeartbeat]]:
    """Every model in ``Names.models_key`` that has at least one live worker, with its heartbeats."""
    members = await redis.smembers(names.models_key)
    models = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
    found = await asyncio.gather(*(read_heartbeats(redis, names, m, max_age_s=max_age_s) for m in models))
    return {model: beats for model, beats in zip(models, found, strict=True) if beats}


class HeartbeatCache:
    """Per-model live heartbeats, refreshed from Redis at most every ``refresh_s`` seconds.

    A worker counts as live while its newest heartbeat is younger than ``max_age_s`` (three heartbeat
    intervals by convention: one lost beat is not a death).
    """

    def __init__(self, redis: Redis, names: Names, *, max_age_s: float, refresh_s: float = 1.0) -> None:
        self._redis = redis
        self._names = names
        self._max_age_s = max_age_s
        self._refresh_s = refresh_s
        self._entries: dict[str, tuple[float, list[WorkerHeartbeat]]] = {}

    async def get(self, model: str) -> list[WorkerHeartbeat]:
        """The model's live heartbeats (possibly up to ``refresh_s`` old)."""
        now = time.monotonic()
        entry = self._entries.get(model)
        if entry is not None and now - entry[0] < self._refresh_s:
            return entry[1]
        with untraced():  # a cache refill serves every request of the next second, not the one that triggered it
            beats = await read_heartbeats(self._redis, self._names, model, max_age_s=self._max_age_s)
        self._entries[model] = (now, beats)
        return beats

    async def live_models(self) -> dict[str, list[WorkerHeartbeat]]:
        """Every model with a live worker, read fresh (listing models is rare)."""
        models = await read_live_models(self._redis, self._names, max_age_s=self._max_age_s)
        now = time.monotonic()
        for model, beats in models.items():
            self._entries[model] = (now, beats)
        return models
