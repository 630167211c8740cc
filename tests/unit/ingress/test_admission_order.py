"""Admission's order and its typed result, without a backbone: ``ingress.accept`` against a stand-in for the
service that records what admission asks of it. A request the queue turns away (a backlog at its bound, a
deadline its workers' backlog cannot meet) is charged nothing, neither rate-limit tokens nor a quota
reservation; an admitted one is charged, then recorded and published in one call; a refusal names the request's
id; and the route gets everything it answers with from :class:`ingress.accept.Accepted`."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from ingress.accept import Accepted, accept, admit, rate_headers
from ingress.auth import ApiKey
from ingress.errors import answered_under
from ingress.ratelimit import RateState, WindowState
from ingress.telemetry import IngressMetrics
from schemas import InferenceRequest, PartitionRef, Tier, WorkerHeartbeat, utcnow
from sluicegate.api.bodies import NativeRequestBody
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import KeyLimits, Limits
from sluicegate.lora.resolve import Resolved
from sluicegate.settings import Settings
from sluicegate.usage.quota import QuotaClaim

MODEL = "m"
LEFT = RateState((WindowState("rpm", 3, 2, 20_000),))


class Recording:
    """The parts of ``IngressService`` admission uses, each call noted in ``calls`` (in order)."""

    def __init__(self, *, backlog_full: bool = False, heartbeats: list[WorkerHeartbeat] | None = None) -> None:
        self.settings = Settings(
            kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0", ingress_count_prompt_tokens=False
        )
        self.metrics = IngressMetrics()
        self.calls: list[str] = []
        self.seen: list[str] = []  # the request ids publishing was asked about
        self._backlog_full = backlog_full
        self._heartbeats = heartbeats or []
        self.adapters = SimpleNamespace(resolve=self._resolve)
        self.routes = SimpleNamespace(resolve=lambda body, tenant, request_key: None)
        self.reader = SimpleNamespace(id="reader-1")
        self.cache = SimpleNamespace(plan=lambda inference, cache_control: (None, False))
        self.backlog = SimpleNamespace(admit=self._admit, accepted=self._accepted)
        self.rate_limiter = SimpleNamespace(acquire=self._acquire)
        self.quotas = SimpleNamespace(reserve=self._reserve)

    async def _resolve(self, model: str, *, tenant: str) -> Resolved:
        return Resolved(model)

    async def model_heartbeats(self, model: str) -> list[WorkerHeartbeat]:
        return self._heartbeats

    async def route(
        self,
        request: InferenceRequest,
        *,
        max_tier: Tier,
        heartbeats: list[WorkerHeartbeat],
        prompt_ids: list[int] | None = None,
        lora_int_id: int | None = None,
    ) -> Any:
        self.calls.append("route")
        self.seen.append(request.request_id)
        return SimpleNamespace(tier=request.priority, topic=f"llm.{MODEL}.{request.priority}", reason="affinity")

    def partitions(self, model: str) -> dict[str, int]:
        return {}

    async def _admit(self, model: str, tier: Tier, heartbeats: Any, partitions: Any) -> None:
        self.calls.append("backlog")
        if self._backlog_full:
            raise ApiError(429, "full; nothing was queued.", code="model_backlog_full", headers={"Retry-After": "1"})

    def _accepted(self, model: str, tier: Tier, topic: str, partition: int, offset: int) -> None:
        self.calls.append("counted")

    async def _acquire(self, key_id: str, limits: Limits, *, tokens: int) -> RateState:
        self.calls.append("rate")
        return LEFT

    async def _reserve(self, claim: QuotaClaim) -> None:
        self.calls.append("quota")

    async def publish(self, request: InferenceRequest, route: Any, trace_carrier: Any) -> Any:
        self.calls.append("publish")
        return SimpleNamespace(topic=route.topic, partition=0, offset=7)


def http_request(service: Recording) -> Request:
    app = SimpleNamespace(state=SimpleNamespace(service=service, tracer=None))
    return Request({"type": "http", "method": "POST", "path": "/v1/requests", "headers": [], "app": app})


# A key with a request rate and a daily token quota: both are charged at admission.
CALLER = ApiKey(key_hash="ab" * 32, tenant="t", limits=KeyLimits(rpm=3, tokens_per_day=10_000))
BODY = NativeRequestBody(model=MODEL, prompt="hello", max_tokens=4)


async def test_an_admitted_request_is_checked_charged_then_recorded_and_published_in_one_call() -> None:
    service = Recording()
    accepted = await accept(http_request(service), CALLER, BODY, "/v1/requests")
    assert service.calls == ["route", "backlog", "rate", "quota", "publish", "counted"]
    assert isinstance(accepted, Accepted)
    assert accepted.request_id == service.seen[0] and accepted.inference.tenant == "t"
    assert (accepted.rate, accepted.tool_call_format, accepted.counted_prompt_tokens) == (LEFT, None, None)
    assert rate_headers(accepted)["x-ratelimit-remaining-requests"] == "2"


async def test_a_request_the_backlog_refuses_is_charged_nothing_and_named_by_its_id() -> None:
    service = Recording(backlog_full=True)
    with pytest.raises(ApiError) as refused:
        await accept(http_request(service), CALLER, BODY, "/v1/requests")
    assert refused.value.code == "model_backlog_full"
    assert service.calls == ["route", "backlog"]  # no rate-limit charge, no quota reservation, nothing published
    assert refused.value.headers == {"x-request-id": service.seen[0], "Retry-After": "1"}


async def test_a_deadline_the_workers_backlog_cannot_meet_is_charged_nothing() -> None:
    beat = WorkerHeartbeat(
        worker_id="w",
        model=MODEL,
        partitions=[PartitionRef(topic=f"llm.{MODEL}.standard", partition=0)],
        running=0,
        waiting=0,
        free_kv_blocks=1,
        total_kv_blocks=1,
        prefix_cache_hit_rate=0.0,
        backlog_seconds={"interactive": 0.0, "standard": 120.0, "batch": 300.0},
    )
    service = Recording(heartbeats=[beat])
    body = BODY.model_copy(update={"deadline": utcnow() + timedelta(seconds=30)})
    with pytest.raises(ApiError) as refused:
        await admit(http_request(service), CALLER, body, "/v1/requests", request_id="given-id")
    assert refused.value.code == "deadline_unmeetable"
    assert service.calls == ["route"]
    assert service.seen == ["given-id"]  # a call of several names its parts up front


def test_the_rate_headers_of_several_parts_are_the_least_any_left() -> None:
    def part(rate: RateState | None) -> Accepted:
        inference = InferenceRequest(request_id="r", model=MODEL, prompt="p")
        return Accepted(inference, None, rate, None)

    later = RateState((WindowState("rpm", 3, 1, 40_000),))
    assert rate_headers(part(LEFT), part(None), part(later))["x-ratelimit-remaining-requests"] == "1"
    assert rate_headers(part(None)) == {}


def test_an_error_is_answered_under_the_request_id_unless_it_names_its_own() -> None:
    with pytest.raises(ApiError) as plain, answered_under("accepted"):
        raise ApiError(504, "timeout", code="timeout")
    assert plain.value.headers == {"x-request-id": "accepted"}
    kept = {"x-should-retry": "false"}
    with pytest.raises(ApiError) as retried, answered_under("accepted"):
        raise ApiError(429, "no", headers=kept)
    assert retried.value.headers == {"x-request-id": "accepted", "x-should-retry": "false"}
    assert kept == {"x-should-retry": "false"}  # the raiser's dict is left as it was
    with pytest.raises(ApiError) as own, answered_under("accepted"):
        raise ApiError(503, "Kafka", headers={"x-request-id": "published"})
    assert own.value.headers == {"x-request-id": "published"}
    with pytest.raises(KeyError), answered_under("accepted"):
        raise KeyError("not an API error: left alone")
