"""Canary rollbacks are shared through Redis: one ingress replica's verdict reaches the others and the route
table the router and the batch worker resolve through, and an edit of the route clears it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from ingress.model_routes import ModelRoutes
from ingress.telemetry import IngressMetrics
from router.canary import Outcome
from router.route_table import RouteTable, load_table
from schemas import InferenceRequest, Names, StreamEvent
from sluicegate.settings import Settings

ROUTES = """
routes:
  chat:
    sticky: none
    targets:
      - {model: stable, weight: %d}
      - {model: canary, weight: 10, canary: true}
    canary: {min_requests: 3}
"""


async def _no_follow(*_: Any, **__: Any) -> AsyncIterator[StreamEvent]:
    raise AssertionError("not followed in this test")
    yield  # pragma: no cover  (makes this an async generator)


def _replica(path: Path, redis: Redis, prefix: str) -> ModelRoutes:
    settings = Settings(routes_file=path, topic_prefix=prefix)
    return ModelRoutes(settings, IngressMetrics(), follow=_no_follow, redis=redis, names=Names(prefix))


async def test_a_rollback_reaches_every_replica_until_the_route_is_edited(
    tmp_path: Path, redis: Redis, unique_prefix: str
) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES % 90)
    first, second = _replica(path, redis, unique_prefix), _replica(path, redis, unique_prefix)
    spec = first.routes.routes["chat"]
    for n in range(3):
        first._judge.record("chat", "stable", Outcome(float(n), True, 0.1))
        first._judge.record("chat", "canary", Outcome(float(n), False, None))
    verdicts = first._judge.verdicts("chat", spec, first.weights("chat", spec), now=10.0)
    assert [v.cause for v in verdicts] == ["error_rate"]
    await first.roll_back(verdicts[0], spec)
    assert first.weights("chat", spec) == {"stable": 90, "canary": 0}

    assert second.weights("chat", spec)["canary"] == 10  # not yet read
    await second.sync()
    assert second.weights("chat", spec) == {"stable": 90, "canary": 0}

    # The router (Kafka-native records) and the batch worker (batch lines) adopt it too: nothing goes to the
    # canary any more, while before the check some requests did.
    router = RouteTable(path, redis=redis, names=Names(unique_prefix))
    requests = [InferenceRequest(request_id=f"r{n}", model="chat", prompt="hi") for n in range(60)]
    assert "canary" in {router.routed(r).model for r in requests}
    assert (await router.refresh()).adopted == {("chat", "canary")}
    assert {router.routed(r).model for r in requests} == {"stable"}

    # An operator edits the route: the old verdict no longer applies, on any replica.
    path.write_text(ROUTES % 80)
    third = _replica(path, redis, unique_prefix)
    await third.sync()
    edited = third.routes.routes["chat"]
    assert third.weights("chat", edited) == {"stable": 80, "canary": 10}
    second.swap(load_table(path))
    await second.sync()
    assert second.weights("chat", edited) == {"stable": 80, "canary": 10}
    assert (await router.refresh()).changed == {"chat"}  # the router reloads the edit: the canary is back
    assert router.weights("chat", edited) == {"stable": 80, "canary": 10}
