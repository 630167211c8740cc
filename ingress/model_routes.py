"""Ingress's model routes: the version each request for a routed name goes to, and the canary watch that rolls
a worse canary back to weight 0 (``router.canary``).

The routes themselves (the file in force, reloaded when it changes, a bad change refused and logged; the fast
path's tokenizers; the rollbacks every process shares through Redis) live in ``router.route_table``, the one
home the router and the batch worker resolve through too; this module adds what only ingress does: counting a
request body's prompt, the routing metrics, and watching each routed request's outcome.

Each ingress replica judges the outcomes it sees; a rollback it decides is logged and written to Redis
(``router.rollbacks``), where every replica, the router and the batch worker pick it up at their next check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from ingress.stream_follow import Follow
from router.canary import CanaryJudge, Outcome, Rollback
from router.rollbacks import share_rollback
from router.route_table import RouteTable, Table
from router.routes import RoutesFile, RouteSpec
from router.versions import VersionChoice
from schemas import DoneEvent, ErrorEvent, Names, TokenEvent
from sluicegate.api.bodies import AnyBody, ChatCompletionBody, NativeRequestBody
from sluicegate.settings import IngressSettings
from sluicegate.task_stop import cancel_and_wait

from .telemetry import IngressMetrics

log = logging.getLogger(__name__)


def prompt_of(body: AnyBody) -> str | list[int]:
    """What the fast path counts: the prompt (text or ids), or the messages' text joined."""
    if isinstance(body, ChatCompletionBody):
        return "\n".join(m.text() for m in body.chat_messages())
    if isinstance(body, NativeRequestBody) and body.prompt is None:
        return "\n".join(m.to_schema().text() for m in body.messages or ())
    return body.prompt  # type: ignore[return-value]  # one prompt, narrowed by the body's validator


class ModelRoutes:
    """The routes in force for one ingress process."""

    def __init__(
        self, settings: IngressSettings, metrics: IngressMetrics, *, follow: Follow, redis: Redis, names: Names
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._follow = follow
        self._redis = redis
        self._names = names
        self.table = RouteTable(settings.routes_file, redis=redis, names=names)
        self._judge = CanaryJudge()
        self._watch: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._publish_weights()

    @property
    def routes(self) -> RoutesFile:
        return self.table.routes

    def start(self) -> None:
        """Start watching the routing file and the shared rollbacks (on the serving loop)."""
        if self._settings.routes_file is not None and self._watch is None:
            self._watch = asyncio.create_task(self._watch_file())

    async def close(self) -> None:
        await cancel_and_wait(self._watch, *self._watchers)

    # --- choosing a version -----------------------------------------------------------------------
    def weights(self, route: str, spec: RouteSpec) -> dict[str, float]:
        """The route's live weights (rolled-back canaries at 0)."""
        return self.table.weights(route, spec)

    def resolve(self, body: AnyBody, *, tenant: str, request_key: str) -> VersionChoice | None:
        """The version a request for a routed name goes to (None: the name is not a route, or is a version)."""
        choice = self.table.choose(
            body.model,
            tenant=tenant,
            user=getattr(body, "user", None),
            request_key=request_key,
            prompt=lambda: prompt_of(body),
        )
        if choice is not None:
            self._metrics.routed.labels(choice.route, choice.version, choice.reason).inc()
        return choice

    # --- canary watch -----------------------------------------------------------------------------
    def observe(self, choice: VersionChoice, request_id: str, tenant: str, accepted_at: float) -> None:
        """Follow a routed request of a route with a canary in the background and judge its outcome."""
        spec = self.table.routes.routes.get(choice.route)
        if spec is None or spec.canary is None or choice.reason != "split":
            return
        task = asyncio.create_task(self._watch_request(choice, spec, request_id, tenant, accepted_at))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch_request(
        self, choice: VersionChoice, spec: RouteSpec, request_id: str, tenant: str, started: float
    ) -> None:
        assert spec.canary is not None
        ttft: float | None = None
        ok = False
        follow = self._follow(request_id, tenant, timeout_s=self._settings.request_timeout_s)
        try:
            async with (
                contextlib.aclosing(follow) as events,
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
        """Set the canary to weight 0 here, log why, and record it in Redis for the other processes."""
        self.table.rolled_back.add((verdict.route, verdict.version))
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
        try:
            await share_rollback(self._redis, self._names, verdict, spec)
        except (RedisError, OSError) as exc:
            log.warning("ingress.canary_rollback_not_shared route=%s error=%r", verdict.route, exc)

    async def sync(self) -> None:
        """One check of the routing file and the shared rollbacks, and what follows from it here."""
        found = await self.table.refresh()
        if found.refused is not None:
            self._metrics.routes_reload_failures.inc()
        if found.changed is not None:
            for route in found.changed:
                self._judge.forget(route)  # the old figures judged other weights
            log.info("ingress.routes_reloaded routes=%s", ",".join(sorted(self.routes.routes)) or "-")
        if found.changed is not None or found.adopted:
            self._publish_weights()

    def swap(self, table: Table) -> None:
        """Put ``table`` in force; a route whose spec changed starts over (rollbacks cleared, outcomes forgotten)."""
        for route in self.table.swap(table):
            self._judge.forget(route)
        self._publish_weights()

    def _publish_weights(self) -> None:
        for route, spec in self.table.routes.routes.items():
            for version, weight in self.weights(route, spec).items():
                self._metrics.route_weight.labels(route, version).set(weight)

    async def _watch_file(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # keep watching: the last good routes stay in force meanwhile
                log.exception("ingress.routes_check_failed")
            await asyncio.sleep(self._settings.routes_reload_s)
