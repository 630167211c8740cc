"""The response cache: a deterministic request (temperature 0, or a seed) that repeats one already answered is
answered from Redis instead of a GPU.

What the key covers: the model version the request was routed to, the request exactly as ingress hands it to
the worker (text prompt or token ids, or the chat messages with their tools), the output constraint
(``guided``) and every sampling parameter, plus the tenant unless ``response_cache_shared``. Ingress does not
tokenize: the worker renders messages through the model's chat template, which is part of the model version,
so the same request maps to the same prompt tokens there. The key is a SHA-256 of that canonical JSON.

What is stored: the reply's stream events (tokens and ``done``), once a worker's stream for a miss ends with
``stop`` or ``length`` and without a restart or error. A hit writes those events, renumbered for the new
request id and with ``usage.cached`` set, into the request's own Redis stream; every reader (the OpenAI SSE
and whole-response paths, the result service's WebSocket and SSE) then serves it exactly as a worker's
stream, which is why clients cannot tell a hit apart except by ``cached`` and a much earlier first token.

``Cache-Control: no-cache`` skips the lookup (the fresh reply still replaces the entry); ``no-store`` skips
the lookup and the store.

A hit replays the first answer. Without the deterministic mode a fresh run could differ from it (the batch it
ran in changed the greedy tokens); with every worker of the model in the mode (``/v1/models`` says
``deterministic``), a hit is exactly what a fresh run would give.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from ingress.stream_follow import Follow
from schemas import (
    STREAM_FIELD,
    DoneEvent,
    InferenceRequest,
    Names,
    RequestRecord,
    StreamEvent,
    TokenEvent,
    stream_entry_id,
    stream_event_adapter,
)
from sluicegate.settings import IngressSettings
from sluicegate.task_stop import cancel_and_wait

from .telemetry import IngressMetrics

log = logging.getLogger(__name__)

#: The fields of a request that decide its reply (with the tenant, unless shared).
_KEYED_FIELDS = frozenset({"model", "prompt", "messages", "sampling", "guided", "tools"})
_CACHE_WORKER_ID = "response-cache"


def deterministic(request: InferenceRequest) -> bool:
    """Whether the request's reply is a function of the request: greedy (temperature 0) or seeded."""
    return request.sampling.temperature == 0 or request.sampling.seed is not None


def cache_directives(header: str | None) -> tuple[bool, bool]:
    """(look up, store) under a request's ``Cache-Control`` header: ``no-cache`` skips the lookup, ``no-store``
    both."""
    directives = {part.strip().lower().split("=", 1)[0] for part in (header or "").split(",")}
    no_store = "no-store" in directives
    return not (no_store or "no-cache" in directives), not no_store


def request_digest(request: InferenceRequest, *, shared: bool) -> str:
    """The hex SHA-256 of the request's canonical JSON (sorted keys) over what decides its reply."""
    keyed: dict[str, Any] = request.model_dump(mode="json", include=set(_KEYED_FIELDS))
    if not shared:
        keyed["tenant"] = request.tenant
    if request.adapter is not None:
        # Only when set, so the digests of base-model requests (and their cached replies) stay what they were.
        keyed["adapter"] = request.adapter
    canonical = json.dumps(keyed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Cached:
    """A looked-up reply: its events, already the new request's, and the entry's size in bytes."""

    events: list[StreamEvent]
    size: int


class ResponseCache:
    """Lookups, replays and background fills for one ingress process."""

    def __init__(
        self, redis: Redis, names: Names, settings: IngressSettings, metrics: IngressMetrics, *, follow: Follow
    ) -> None:
        self._redis = redis
        self._names = names
        self._settings = settings
        self._metrics = metrics
        self._follow = follow
        self._fills: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._settings.response_cache_ttl_s > 0

    def plan(self, request: InferenceRequest, cache_control: str | None) -> tuple[str | None, bool]:
        """The request's cache key (None: not cacheable or the cache is off) and whether to look it up."""
        if not self.enabled or request.task != "generate" or not deterministic(request):
            return None, False
        lookup, store = cache_directives(cache_control)
        if not store:
            self._metrics.response_cache.labels(request.model, "bypass").inc()
            return None, False
        if not lookup:
            self._metrics.response_cache.labels(request.model, "bypass").inc()
        digest = request_digest(request, shared=self._settings.response_cache_shared)
        return self._names.response_cache_key(request.model, digest), lookup

    async def lookup(self, request: InferenceRequest, key: str) -> Cached | None:
        """The cached reply at ``key`` as ``request``'s events, or None on a miss (a Redis failure or a damaged
        entry counts as a miss: the worker answers instead)."""
        try:
            raw = await self._redis.get(key)
            events = None if raw is None else _renumbered(raw, request.request_id)
        except (RedisError, OSError) as exc:
            log.warning("ingress.response_cache_unavailable error=%r", exc)
            events = None
        if not events:
            self._metrics.response_cache.labels(request.model, "miss").inc()
            return None
        return Cached(events, len(raw or b""))

    async def replay(self, request: InferenceRequest, cached: Cached) -> bool:
        """Answer ``request`` with a looked-up reply: its events go into the request's stream (and a ``finished``
        status record) in one round trip. False when Redis fails (then the worker answers instead)."""
        events = cached.events
        record = RequestRecord(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            priority=request.priority,
            status="finished",
            created_at=request.created_at,
            worker_id=_CACHE_WORKER_ID,
            trace=request.trace,
        )
        stream = self._names.stream_key(request.request_id, request.tenant)
        pipe = self._redis.pipeline(transaction=False)
        for event in events:
            pipe.xadd(stream, {STREAM_FIELD: event.model_dump_json()}, id=stream_entry_id(event.seq))
        pipe.expire(stream, self._settings.stream_ttl_s)
        pipe.set(
            self._names.request_key(request.request_id, request.tenant),
            record.model_dump_json(),
            ex=self._settings.request_record_ttl_s,
        )
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("ingress.response_cache_replay_failed request_id=%s error=%r", request.request_id, exc)
            with contextlib.suppress(RedisError, OSError):
                await self._redis.delete(stream)
            self._metrics.response_cache.labels(request.model, "miss").inc()
            return False
        self._metrics.response_cache.labels(request.model, "hit").inc()
        self._metrics.response_cache_bytes.labels("served").inc(cached.size)
        return True

    def fill_later(self, request: InferenceRequest, key: str) -> None:
        """Follow the published request's stream in the background and keep its reply under ``key``."""
        task = asyncio.create_task(self._fill(request, key))
        self._fills.add(task)
        task.add_done_callback(self._fills.discard)

    async def _fill(self, request: InferenceRequest, key: str) -> None:
        request_id, model = request.request_id, request.model
        events: list[StreamEvent] = []
        try:
            async for event in self._follow(request_id, request.tenant, timeout_s=self._settings.request_timeout_s):
                if not isinstance(event, TokenEvent | DoneEvent):
                    return  # a restart or an error: not a reply worth repeating
                events.append(event)
        except Exception as exc:  # a background task: log, never raise into the loop
            log.info("ingress.response_cache_fill_skipped request_id=%s error=%r", request_id, exc)
            return
        done = events[-1] if events else None
        if not isinstance(done, DoneEvent) or done.finish_reason not in ("stop", "length"):
            return
        payload = json.dumps([e.model_dump(mode="json") for e in events], separators=(",", ":"))
        if len(payload) > self._settings.response_cache_max_bytes:
            return
        try:
            await self._redis.set(key, payload, ex=self._settings.response_cache_ttl_s)
        except (RedisError, OSError) as exc:
            log.warning("ingress.response_cache_store_failed request_id=%s error=%r", request_id, exc)
            return
        self._metrics.response_cache_bytes.labels("stored").inc(len(payload))
        log.debug("ingress.response_cache_stored request_id=%s model=%s bytes=%d", request_id, model, len(payload))

    async def close(self) -> None:
        """Stop the fills still following streams."""
        await cancel_and_wait(*self._fills)


def _renumbered(raw: bytes | str, request_id: str) -> list[StreamEvent] | None:
    """The cached events as ``request_id``'s, seq from 0, the ``done`` marked ``cached``; None when damaged."""
    try:
        items = json.loads(raw)
        events = []
        for seq, item in enumerate(items):
            item["request_id"], item["seq"] = request_id, seq
            if item.get("type") == "done":
                item["usage"]["cached"] = True
            events.append(stream_event_adapter.validate_python(item))
    except (ValueError, TypeError, KeyError, ValidationError) as exc:
        log.warning("ingress.response_cache_damaged_entry error=%r", exc)
        return None
    return events
