"""Ingress's model routes: the routing file in force (reloaded when it changes, a bad change refused and
logged), the version each request for a routed name goes to (``router.versions``), counting a prompt's tokens
for the fast path, and the canary watch that rolls a worse canary back to weight 0 (``router.canary``).

Counting: with the fast-path model's ``tokenizer.json`` (the ``tokenizers`` library, which Hugging Face's fast
tokenizers are built on, without loading ``transformers`` into ingress). A chat request counts its messages'
text, not the chat template's few framing tokens; token-id prompts count their ids. A prompt longer than
``_MAX_CHARS_PER_TOKEN`` characters per allowed token is not short, and is not tokenized on the event loop.

Each ingress replica judges the outcomes it sees; a rollback it decides is logged and written to Redis, where
every replica picks it up at its next file check (so all of them stop sending traffic to the canary, and a
restarted one does not forget). A rollback applies to the route as it was written (a digest of its spec):
editing the route in the file (an operator's decision) clears it everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError
from tokenizers import Tokenizer

from router.canary import CanaryJudge, Outcome, Rollback
from router.route_table import file_stamp as _stamp
from router.route_table import sticky_key
from router.routes import RoutesError, RoutesFile, RouteSpec, load_routes
from router.versions import VersionChoice, choose_version
from schemas import DoneEvent, ErrorEvent, Names, StreamEvent, TokenEvent
from sluicegate.settings import Settings

from .bodies import AnyBody, ChatCompletionBody, NativeRequestBody
from .telemetry import IngressMetrics

log = logging.getLogger(__name__)

# No tokenizer in use averages more characters than this per token; a longer prompt is long without counting.
_MAX_CHARS_PER_TOKEN = 32
# A rollback outlives any sensible canary window; an operator edits the route long before this.
_ROLLBACK_TTL_S = 7 * 24 * 3600

Follow = Callable[..., AsyncIterator[StreamEvent]]


@dataclass(frozen=True)
class _Table:
    routes: RoutesFile
    tokenizers: dict[str, Tokenizer]
    stamp: tuple[int, int, int] | None


def load_table(path: Path) -> _Table:
    """The routing file and its fast paths' tokenizers (blocking); ``RoutesError`` for anything unusable."""
    stamp = _stamp(path)
    routes = load_routes(path)
    tokenizers: dict[str, Tokenizer] = {}
    for name, spec in routes.routes.items():
        if spec.fast_path is None:
            continue
        file = spec.fast_path.tokenizer / "tokenizer.json"
        try:
            tokenizers[name] = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own Exception type for a missing or bad file
            raise RoutesError(f"{path}: route {name!r}: fast_path.tokenizer: cannot load {file}: {exc}") from None
    return _Table(routes, tokenizers, stamp)


def spec_digest(spec: RouteSpec) -> str:
    """A short digest of a route as written: a rollback recorded under it applies to this spec only."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


def prompt_of(body: AnyBody) -> str | list[int]:
    """What the fast path counts: the prompt (text or ids), or the messages' text joined."""
    if isinstance(body, ChatCompletionBody):
        return "\n".join(m.text() for m in body.chat_messages())
    if isinstance(body, NativeRequestBody) and body.prompt is None:
        return "\n".join(m.to_schema().text() for m in body.messages or ())
    return body.prompt  # type: ignore[return-value]  # one prompt, narrowed by the body's validator


def count_tokens(tokenizer: Tokenizer, prompt: str | list[int], limit: int) -> int | None:
    """The prompt's token count, or ``limit`` for a text too long to be under it (not tokenized)."""
    if not isinstance(prompt, str):
        return len(prompt)
    if len(prompt) > _MAX_CHARS_PER_TOKEN * limit:
        return limit
    return len(tokenizer.encode(prompt).ids)


class ModelRoutes:
    """The routes in force for one ingress process."""

    def __init__(
        self, settings: Settings, metrics: IngressMetrics, *, follow: Follow, redis: Redis, names: Names
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._follow = follow
        self._redis = redis
        self._names = names
        self._path = settings.routes_file
        # Loaded at start-up, so a bad file stops ingress with the reason instead of serving without routes.
        self._table = load_table(self._path) if self._path is not None else _Table(RoutesFile(), {}, None)
        self._rolled_back: set[tuple[str, str]] = set()
        self._judge = CanaryJudge()
        self._watch: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._publish_weights()

    @property
    def routes(self) -> RoutesFile:
        return self._table.routes

    def start(self) -> None:
        """Start watching the routing file (on the serving loop)."""
        if self._path is not None and self._watch is None:
            self._watch = asyncio.create_task(self._watch_file(self._path))

    async def close(self) -> None:
        for task in [*([self._watch] if self._watch else []), *self._watchers]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # --- choosing a version -----------------------------------------------------------------------
    def weights(self, route: str, spec: RouteSpec) -> dict[str, float]:
        """The route's live weights: the file's, with rolled-back canaries at 0 (and the stable versions
        sharing evenly should nothing else be left)."""
        live = {t.model: 0.0 if (route, t.model) in self._rolled_back else t.weight for t in spec.targets}
        if not any(w > 0 for w in live.values()):
            live = {t.model: 0.0 if t.canary else 1.0 for t in spec.targets}
        return live

    def resolve(self, body: AnyBody, *, tenant: str, request_key: str) -> VersionChoice | None:
        """The version a request for a routed name goes to (None: the name is not a route, or is a version)."""
        spec = self._table.routes.routes.get(body.model)
        if spec is None:
            return None
        user = getattr(body, "user", None)
        sticky = sticky_key(spec, tenant=tenant, user=user, request_key=request_key)
        tokenizer = self._table.tokenizers.get(body.model)
        choice = choose_version(
            body.model,
            spec,
            sticky_key=sticky,
            weights=self.weights(body.model, spec),
            prompt_tokens=lambda limit: None if tokenizer is None else count_tokens(tokenizer, prompt_of(body), limit),
        )
        self._metrics.routed.labels(choice.route, choice.version, choice.reason).inc()
        return choice

    # --- canary watch -----------------------------------------------------------------------------
    def observe(self, choice: VersionChoice, request_id: str, accepted_at: float) -> None:
        """Follow a routed request of a route with a canary in the background and judge its outcome."""
        spec = self._table.routes.routes.get(choice.route)
        if spec is None or spec.canary is None or choice.reason != "split":
            return
        task = asyncio.create_task(self._watch_request(choice, spec, request_id, accepted_at))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch_request(self, choice: VersionChoice, spec: RouteSpec, request_id: str, started: float) -> None:
        assert spec.canary is not None
        ttft: float | None = None
        ok = False
        try:
            async with (
                contextlib.aclosing(self._follow(request_id, timeout_s=self._settings.request_timeout_s)) as events,
                asyncio.timeout(spec.canary.first_token_timeout_s) as scope,
            ):
                async for event in events:
                    if isinstance(event, TokenEvent) and ttft is None:
                        ttft = time.perf_counter() - started
                        scope.reschedule(None)  # it answered: the rest may take as long as it takes
                    elif isinstance(event, DoneEvent):
                        ok = event.finish_reason != "error"
                    elif isinstance(event, ErrorEvent):
                        break
        except TimeoutError:
            pass  # no first token in time: a failure
        except Exception as exc:  # Redis trouble is ingress's, not the version's: no verdict from it
            log.info("ingress.canary_watch_lost request_id=%s error=%r", request_id, exc)
            return
        self._judge.record(choice.route, choice.version, Outcome(time.monotonic(), ok, ttft))
        for verdict in self._judge.verdicts(choice.route, spec, self.weights(choice.route, spec), now=time.monotonic()):
            await self.roll_back(verdict, spec)

    async def roll_back(self, verdict: Rollback, spec: RouteSpec) -> None:
        """Set the canary to weight 0 here, log why, and record it in Redis for the other replicas."""
        self._rolled_back.add((verdict.route, verdict.version))
        self._metrics.canary_rollbacks.labels(verdict.route, verdict.version, verdict.cause).inc()
        self._publish_weights()
        log.warning(
            "ingress.canary_rolled_back route=%s version=%s cause=%s canary[%s] stable[%s]",
            verdict.route,
            verdict.version,
            verdict.cause,
            verdict.canary.line(),
            verdict.stable.line(),
        )
        record = {"spec": spec_digest(spec), "cause": verdict.cause, "at": time.time()}
        try:
            key = self._names.route_rollback_key(verdict.route, verdict.version)
            await self._redis.set(key, json.dumps(record), ex=_ROLLBACK_TTL_S)
        except (RedisError, OSError) as exc:
            log.warning("ingress.canary_rollback_not_shared route=%s error=%r", verdict.route, exc)

    async def sync_rollbacks(self) -> None:
        """Take in the rollbacks other replicas recorded for the routes as they are now written."""
        wanted = [
            (route, t.model, spec_digest(spec))
            for route, spec in self._table.routes.routes.items()
            for t in spec.targets
            if t.canary and (route, t.model) not in self._rolled_back
        ]
        if not wanted:
            return
        raw = await self._redis.mget([self._names.route_rollback_key(r, v) for r, v, _ in wanted])
        changed = False
        for (route, version, digest), value in zip(wanted, raw, strict=True):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                if value is not None and json.loads(value)["spec"] == digest:
                    self._rolled_back.add((route, version))
                    log.info("ingress.canary_rollback_adopted route=%s version=%s", route, version)
                    changed = True
        if changed:
            self._publish_weights()

    def _publish_weights(self) -> None:
        for route, spec in self._table.routes.routes.items():
            for version, weight in self.weights(route, spec).items():
                self._metrics.route_weight.labels(route, version).set(weight)

    # --- reloading --------------------------------------------------------------------------------
    async def _watch_file(self, path: Path) -> None:
        while True:
            try:
                await self.sync_rollbacks()
            except (RedisError, OSError) as exc:
                log.warning("ingress.canary_rollbacks_unread error=%r", exc)
            await asyncio.sleep(self._settings.routes_reload_s)
            stamp = await asyncio.to_thread(_stamp, path)
            if stamp is None or stamp == self._table.stamp:
                continue
            try:
                table = await asyncio.to_thread(load_table, path)
            except RoutesError as exc:
                self._metrics.routes_reload_failures.inc()
                log.error("ingress.routes_reload_failed error=%s; the previous routes stay in force", exc)
                self._table = _Table(self._table.routes, self._table.tokenizers, stamp)  # not again until changed
                continue
            self.swap(table)

    def swap(self, table: _Table) -> None:
        """Put ``table`` in force; a route whose spec changed starts over (rollbacks cleared, outcomes forgotten)."""
        old = self._table.routes.routes
        for route, spec in table.routes.routes.items():
            if old.get(route) != spec:
                self._judge.forget(route)
                self._rolled_back = {(r, v) for r, v in self._rolled_back if r != route}
        self._table = table
        self._publish_weights()
        log.info("ingress.routes_reloaded routes=%s", ",".join(sorted(table.routes.routes)) or "-")
