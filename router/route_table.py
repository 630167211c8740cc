"""The routes in force for one process, the one home of choosing a version for a request naming a route:
ingress (``ingress.model_routes``, for the requests it accepts), the router (``router.stream``, for Kafka-native
requests written straight to ``llm.inbound``) and the batch worker (batch lines) all resolve through it, with
the same rule (``router.versions.choose_version``), sticky key, fast path and canary rollbacks.

What it holds: the routing file (re-read when its stat stamp changes, checked by ``refresh``: ingress and the
router call it every ``SLUICEGATE_ROUTES_RELOAD_S`` beside their serving loops, the batch worker before it
validates a batch, at most every ``check_every_s``; a bad edit is logged and the last good routes kept), each
fast path's tokenizer (``router.fast_path``), and the canaries rolled back to weight 0 (``router.rollbacks``:
read from Redis at each check, so a verdict any ingress replica records reaches every process; a route whose
spec changed starts over). The file and the tokenizers are read off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError
from tokenizers import Tokenizer

from schemas import InferenceRequest, Names

from .fast_path import count_tokens, load_tokenizers, request_prompt
from .rollbacks import RolledBack, live_weights, read_rollbacks, still_standing
from .routes import RoutesError, RoutesFile, RouteSpec, load_routes
from .versions import VersionChoice, choose_version

log = logging.getLogger(__name__)


def sticky_key(spec: RouteSpec, *, tenant: str, user: str | None, request_key: str) -> str:
    """The key a route's stickiness hashes: the tenant, the end user (else the tenant), or the request."""
    return {"tenant": tenant, "user": f"user:{user}" if user else tenant, "none": request_key}[spec.sticky]


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a changed routing file apart (None: unreadable)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


@dataclass(frozen=True)
class Table:
    """A routing file as loaded: its routes, their fast paths' tokenizers, and the stamp it was read at."""

    routes: RoutesFile = field(default_factory=RoutesFile)
    tokenizers: dict[str, Tokenizer] = field(default_factory=dict)
    stamp: tuple[int, int, int] | None = None


def load_table(path: Path) -> Table:
    """The routing file and its fast paths' tokenizers (blocking); ``RoutesError`` for anything unusable."""
    stamp = file_stamp(path)
    routes = load_routes(path)
    return Table(routes, load_tokenizers(routes, source=path), stamp)


@dataclass(frozen=True)
class Refreshed:
    """What one check found: the routes whose spec changed (None: no new file), a refused edit, and the
    rollbacks newly read from Redis."""

    changed: set[str] | None = None
    refused: str | None = None
    adopted: RolledBack = field(default_factory=set)


class RouteTable:
    """The routes in force (empty without a routing file)."""

    def __init__(
        self,
        path: Path | None,
        *,
        check_every_s: float = 0.0,
        redis: Redis | None = None,
        names: Names | None = None,
    ) -> None:
        self._path = path
        self._check_every_s = check_every_s
        self._next_check = 0.0
        self._empty_stamp: tuple[int, int, int] | None = None  # the empty file last warned about
        self._redis = redis
        self._names = names or Names()
        # Loaded at start-up, so a bad file stops the process with the reason instead of routing without it.
        self._table = load_table(path) if path is not None else Table()
        self.rolled_back: RolledBack = set()

    @property
    def routes(self) -> RoutesFile:
        return self._table.routes

    def weights(self, route: str, spec: RouteSpec) -> dict[str, float]:
        """The route's live weights (rolled-back canaries at 0)."""
        return live_weights(route, spec, self.rolled_back)

    # --- choosing a version -----------------------------------------------------------------------
    def choose(
        self, model: str, *, tenant: str, user: str | None, request_key: str, prompt: Callable[[], str | list[int]]
    ) -> VersionChoice | None:
        """The version a request for ``model`` goes to (None: ``model`` is not a route; a version named
        directly is pinned). ``prompt`` is asked only when the route has a fast path."""
        spec = self._table.routes.routes.get(model)
        if spec is None:
            return None
        tokenizer = self._table.tokenizers.get(model)
        return choose_version(
            model,
            spec,
            sticky_key=sticky_key(spec, tenant=tenant, user=user, request_key=request_key),
            weights=self.weights(model, spec),
            prompt_tokens=lambda limit: None if tokenizer is None else count_tokens(tokenizer, prompt(), limit),
        )

    def resolve(self, request: InferenceRequest) -> VersionChoice | None:
        """The version a pipeline request naming a route goes to (Kafka-native records, batch lines)."""
        return self.choose(
            request.model,
            tenant=request.tenant,
            user=request.user,
            request_key=request.request_id,
            prompt=lambda: request_prompt(request),
        )

    def routed(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` for the version its route chooses (unchanged when its model is not a route)."""
        choice = self.resolve(request)
        return request if choice is None else request.model_copy(update={"model": choice.version})

    # --- keeping current --------------------------------------------------------------------------
    def swap(self, table: Table) -> set[str]:
        """Put ``table`` in force; returns the routes whose spec changed (their rollbacks are cleared)."""
        old = self._table.routes.routes
        changed = {route for route, spec in table.routes.routes.items() if old.get(route) != spec}
        self.rolled_back = still_standing(self.rolled_back, old, table.routes.routes)
        self._table = table
        return changed

    async def refresh(self) -> Refreshed:
        """At most every ``check_every_s``: re-read the file if it changed (keeping the last good routes when
        the new text is refused), then take in the rollbacks recorded in Redis."""
        if time.monotonic() < self._next_check:
            return Refreshed()
        self._next_check = time.monotonic() + self._check_every_s
        changed: set[str] | None = None
        refused: str | None = None
        if self._path is not None:
            stamp = await asyncio.to_thread(file_stamp, self._path)
            if stamp is not None and stamp != self._table.stamp and stamp[1] == 0:
                # Empty: most likely caught between a writer's truncate and its write (a read then swapped in no
                # routes at all). Kept out of force and read again at the next check; `routes: {}` removes all.
                if stamp != self._empty_stamp:
                    self._empty_stamp = stamp
                    log.warning("routes.file_empty path=%s; the previous routes stay in force", self._path)
            elif stamp is not None and stamp != self._table.stamp:
                try:
                    changed = self.swap(await asyncio.to_thread(load_table, self._path))
                except RoutesError as exc:
                    refused = str(exc)
                    log.error("routes.reload_refused error=%s; the previous routes stay in force", exc)
                    # Not tried again until the file changes once more.
                    self._table = Table(self._table.routes, self._table.tokenizers, stamp)
        adopted: RolledBack = set()
        if self._redis is not None:
            try:
                adopted = await read_rollbacks(self._redis, self._names, self.routes, self.rolled_back)
            except (RedisError, OSError) as exc:
                log.warning("routes.canary_rollbacks_unread error=%r", exc)
            for route, version in sorted(adopted):
                log.info("routes.canary_rollback_adopted route=%s version=%s", route, version)
            self.rolled_back |= adopted
        return Refreshed(changed, refused, adopted)
