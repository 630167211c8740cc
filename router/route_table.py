"""The router's view of the routing file, for Kafka-native requests that name a routed public model.

Ingress resolves the routes of the requests it accepts (``ingress.model_routes``); a producer writing straight
to ``llm.inbound`` bypasses it, so the router resolves the same routes with the same rule
(``router.versions.choose_version``) before it looks the model up. The file is re-read when its stat stamp
changes (a cheap ``os.stat`` per record batch, not per record); a bad edit is logged and the last good table
kept, as in ingress.

Known gaps (issue 21 follow-up): canary rollbacks recorded by ingress in Redis are not applied here yet, and
the fast path is not taken (the router loads no tokenizer), so such records take the weighted sticky split.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from schemas import InferenceRequest

from .routes import RoutesError, RoutesFile, RouteSpec, load_routes
from .versions import VersionChoice, choose_version

log = logging.getLogger(__name__)


def sticky_key(spec: RouteSpec, *, tenant: str, user: str | None, request_key: str) -> str:
    """The key a route's stickiness hashes: the tenant, the end user (else the tenant), or the request."""
    return {"tenant": tenant, "user": f"user:{user}" if user else tenant, "none": request_key}[spec.sticky]


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a changed routing file apart (None: unreadable); shared with ingress's watch."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class RouteTable:
    """The routes in force for one router process (empty without a routing file)."""

    def __init__(self, path: Path | None, *, check_every_s: float = 0.0) -> None:
        self._path = path
        # The router refreshes once per record batch; checking the file at most this often (ingress's
        # SLUICEGATE_ROUTES_RELOAD_S) keeps the stat off most batches.
        self._check_every_s = check_every_s
        self._next_check = 0.0
        self._stamp = file_stamp(path) if path is not None else None
        # Loaded at start-up, so a bad file stops the router with the reason instead of routing without it.
        self._routes = load_routes(path) if path is not None else RoutesFile()

    @property
    def routes(self) -> RoutesFile:
        return self._routes

    def refresh(self) -> None:
        """Re-read the file if it changed; keep the last good routes when the new text is refused."""
        if self._path is None or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + self._check_every_s
        stamp = file_stamp(self._path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._routes = load_routes(self._path)
        except RoutesError as exc:
            log.error("router.routes_refused path=%s error=%s", self._path, exc)

    def resolve(self, request: InferenceRequest) -> VersionChoice | None:
        """The version a request naming a route goes to (None: its model is not a route)."""
        spec = self._routes.routes.get(request.model)
        if spec is None:
            return None
        weights = {t.model: t.weight for t in spec.targets}
        if not any(w > 0 for w in weights.values()):
            weights = {t.model: 0.0 if t.canary else 1.0 for t in spec.targets}
        key = sticky_key(spec, tenant=request.tenant, user=None, request_key=request.request_id)
        return choose_version(request.model, spec, sticky_key=key, weights=weights, prompt_tokens=lambda _: None)
