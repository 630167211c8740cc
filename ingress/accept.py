"""Accepting a request, the step every publishing endpoint shares: resolve its tier, check it against the
caller's limits and the model's live workers, build the pipeline's :class:`schemas.InferenceRequest` and
publish it under a span whose context travels in the Kafka headers."""

from __future__ import annotations

import uuid

from fastapi import Request
from opentelemetry import propagate
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from router.policy import resolve_tier
from schemas import InferenceRequest, TraceContext, utcnow
from schemas.names import HEADER_TRACEPARENT, HEADER_TRACESTATE

from .app_state import service_of, tracer_of
from .auth import ApiKey
from .bodies import AnyBody, build_request
from .errors import ApiError, invalid
from .limits import check_prompt_tokens, check_rate_cost, checked_max_tokens

# The statuses accepting a request can answer (documented on every publishing endpoint).
SUBMIT_ERRORS = (400, 401, 404, 413, 422, 429, 503)


async def accept(request: Request, caller: ApiKey, body: AnyBody, endpoint: str) -> InferenceRequest:
    """Check the model, build the pipeline request and publish it under a span whose context travels
    in the Kafka headers."""
    service = service_of(request)
    tier = resolve_tier(body.priority, default_tier=caller.default_tier, max_tier=caller.max_tier)
    limits = caller.limits.resolve(service.settings)
    prompt_tokens = check_prompt_tokens(body, limits)
    max_tokens = checked_max_tokens(body, limits)
    check_rate_cost(prompt_tokens + max_tokens, limits)
    heartbeats = await service.model_heartbeats(body.model)
    parent = propagate.extract(dict(request.headers))
    with tracer_of(request).start_as_current_span(f"ingress {endpoint}", context=parent, kind=SpanKind.SERVER) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        trace = None
        if HEADER_TRACEPARENT in carrier:
            trace = TraceContext(traceparent=carrier[HEADER_TRACEPARENT], tracestate=carrier.get(HEADER_TRACESTATE))
        now = utcnow()
        try:
            inference = build_request(
                body,
                request_id=uuid.uuid4().hex,
                tenant=caller.tenant,
                tier=tier,
                trace=trace,
                now=now,
                max_tokens=max_tokens,
                default_deadline=limits.default_deadline(now),
            )
        except ValidationError as exc:
            raise invalid(exc) from exc
        except ValueError as exc:  # the only other refusal: a deadline already past
            raise ApiError(422, str(exc), code="invalid_value", param="deadline") from exc
        span.set_attribute("sluicegate.request_id", inference.request_id)
        span.set_attribute("sluicegate.model", inference.model)
        span.set_attribute("sluicegate.tier", tier)
        route = await service.submit(
            inference,
            max_tier=caller.max_tier,
            heartbeats=heartbeats,
            trace_carrier=carrier,
            key_id=caller.key_id,
            limits=limits,
            tokens=prompt_tokens + max_tokens,
        )
        span.set_attribute("messaging.destination.name", route.topic)
        span.set_attribute("sluicegate.route_reason", route.reason)
    return inference
