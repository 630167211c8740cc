"""Accepting a request, the step every publishing endpoint shares: resolve its model name (a LoRA adapter's name
becomes its base model + the adapter, ``sluicegate.lora.resolve``; a routed name a version), resolve its tier,
check it against the caller's limits and the model's live workers, build the pipeline's
:class:`schemas.InferenceRequest` from the body (``build_request``) and publish it under a span whose context
travels in the Kafka headers."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from fastapi import Request
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind
from pydantic import ValidationError

from router.policy import resolve_tier
from schemas import InferenceRequest, ToolCallFormat, TraceContext, WorkerHeartbeat, utcnow
from schemas.names import HEADER_TRACEPARENT, HEADER_TRACESTATE
from sluicegate.api.bodies import AnyBody
from sluicegate.api.build import advertised_tool_call_format, build_request
from sluicegate.api.deadlines import DEADLINE_HEADER, parse_deadline
from sluicegate.api.errors import ApiError, invalid
from sluicegate.api.limits import (
    Limits,
    check_context,
    check_prompt_tokens,
    check_rate_cost,
    checked_max_tokens,
    model_context,
)
from sluicegate.api.prompt_tokens import ModelTokenizers, check_prompt_fits
from sluicegate.telemetry import child_traceparent, genai_operation, genai_request_attributes, tracing_enabled
from sluicegate.usage.quota import claim_for

from .app_state import service_of, tracer_of
from .auth import ApiKey
from .ratelimit import RateState
from .usage_ledger import cache_hit_record

# The statuses accepting a request can answer (documented on every publishing endpoint); 504: its deadline passed
# while it was being accepted.
SUBMIT_ERRORS = (400, 401, 404, 413, 429, 503, 504)


async def accept(
    request: Request, caller: ApiKey, body: AnyBody, endpoint: str, *, relayed: bool = True
) -> InferenceRequest:
    """Check the model, build the pipeline request and publish it under a span whose context travels
    in the Kafka headers. ``relayed``: only this HTTP response carries the output, and its client cannot resume
    it, so the request names this instance's reader lease (its workers stop it if this instance dies)."""
    service = service_of(request)
    body = _with_header_deadline(body, request.headers.get(DEADLINE_HEADER))
    accepted_at = time.perf_counter()
    request_id = uuid.uuid4().hex
    if not hasattr(request.state, "request_id"):  # an error after this names the request (the first of several)
        request.state.request_id = request_id
    # A LoRA adapter's name (visible to this tenant) is its base model + the adapter, from a cached snapshot of
    # the registry (no Redis round trip here); any other name is left to the model checks below (their 404).
    resolved = await service.adapters.resolve(body.model, tenant=caller.tenant)
    adapter = resolved.adapter
    if adapter is not None:
        body = body.model_copy(update={"model": resolved.model})
    version = service.routes.resolve(body, tenant=caller.tenant, request_key=request_id)
    if version is not None:
        # A routed public name: from here on the request is for the chosen version (its workers, its topic, its
        # cache entries, and the ``model`` of the response).
        body = body.model_copy(update={"model": version.version})
    tier = resolve_tier(body.priority, default_tier=caller.default_tier, max_tier=caller.max_tier)
    limits = caller.limits.resolve(service.settings)
    prompt_tokens = check_prompt_tokens(body, limits)
    max_tokens = checked_max_tokens(body, limits)
    check_rate_cost(prompt_tokens + max_tokens, limits)
    heartbeats = await service.model_heartbeats(body.model)
    max_tokens = check_context(body, max_tokens, model_context(heartbeats))
    request.state.tool_call_format = advertised_tool_call_format(heartbeats)
    with _request_span(request, endpoint) as (span, carrier):
        trace = None
        if HEADER_TRACEPARENT in carrier:
            trace = TraceContext(traceparent=carrier[HEADER_TRACEPARENT], tracestate=carrier.get(HEADER_TRACESTATE))
        now = utcnow()
        try:
            inference = build_request(
                body,
                request_id=request_id,
                tenant=caller.tenant,
                tier=tier,
                trace=trace,
                now=now,
                max_tokens=max_tokens,
                default_deadline=limits.default_deadline(now),
                key_id=caller.key_id,
                adapter=adapter,
                reader=service.reader.id if relayed else None,
            )
        except ValidationError as exc:
            raise invalid(exc) from exc
        except ValueError as exc:  # the only other refusal: a deadline already past
            raise ApiError(400, str(exc), code="invalid_value", param="deadline") from exc
        counted: int | None = None  # the prompt's exact tokens, when counted with the model's tokenizer
        if service.settings.ingress_count_prompt_tokens:
            inference, counted = await _fit_context(service.tokenizers, inference, body, heartbeats)
        counted_prompts(request)[request_id] = counted  # the running usage of a ``continuous_usage_stats`` stream
        quota = claim_for(inference, service.settings, key_id=caller.key_id, key_limits=limits, prompt_tokens=counted)
        if span is not None:
            span.update_name(f"{genai_operation(inference)} {inference.model}")
            span.set_attributes(genai_request_attributes(inference))
        cache_key, lookup = service.cache.plan(inference, request.headers.get("cache-control"))
        charge: Limits | None = limits
        cached = await service.cache.lookup(inference, cache_key) if lookup and cache_key is not None else None
        if cached is not None:
            # Answered from the response cache: no GPU, but the key still pays for the call (first: a 429 leaves
            # nothing behind).
            _keep_rate(request, await service.charge(caller.key_id, limits, prompt_tokens + max_tokens))
            if quota is not None:
                await service.reserve(quota)  # settled by the rollup, from the usage record sent below
            if await service.cache.replay(inference, cached):
                if (record := cache_hit_record(inference, cached.events)) is not None:
                    service.usage.send_later(record)
                if span is not None:
                    span.set_attribute("sluicegate.route_reason", "response_cache")
                return inference
            charge = None  # already charged: the worker answers, and submit must not charge again
        route, rate = await service.submit(
            inference,
            max_tier=caller.max_tier,
            heartbeats=heartbeats,
            trace_carrier=carrier,
            key_id=caller.key_id,
            limits=charge,
            tokens=prompt_tokens + max_tokens,
            quota=quota,
        )
        _keep_rate(request, rate)
        if cache_key is not None:
            service.cache.fill_later(inference, cache_key)
        if version is not None:
            service.routes.observe(version, inference.request_id, accepted_at)
        if span is not None:
            span.set_attributes({"messaging.destination.name": route.topic, "sluicegate.route_reason": route.reason})
    return inference


def counted_prompts(request: Request) -> dict[str, int | None]:
    """The prompt tokens ingress counted for each request this HTTP request accepted, by request id (one, or
    one per prompt of a list); None where it could not count them."""
    counts: dict[str, int | None] | None = getattr(request.state, "counted_prompts", None)
    if counts is None:
        counts = request.state.counted_prompts = {}
    return counts


def rate_headers(request: Request) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the answer: what the caller's rate limits had left once this HTTP
    request's last accepted request was charged; none when the key has no limits (or nothing was charged)."""
    rate: RateState | None = getattr(request.state, "rate_limit", None)
    return rate.headers() if rate is not None else {}


def _keep_rate(request: Request, rate: RateState | None) -> None:
    # Several prompts or inputs are charged concurrently, and their answers may come back in any order: the headers
    # keep the least that any of them left.
    if rate is not None:
        kept: RateState | None = getattr(request.state, "rate_limit", None)
        request.state.rate_limit = rate if kept is None else kept.tightest(rate)


def answered_model(inference: InferenceRequest) -> str:
    """The model name a response reports: the adapter's for an adapter request (what the client asked for, as
    vLLM answers), else the model (a routed name's chosen version)."""
    return inference.adapter or inference.model


def _with_header_deadline(body: AnyBody, header: str | None) -> AnyBody:
    """The body with the ``X-Request-Deadline`` header's deadline when it gives none itself (the body's field
    wins); a header that is no deadline is a 400 naming it."""
    if header is None or body.deadline is not None:
        return body
    try:
        deadline = parse_deadline(header)
        if isinstance(deadline, datetime) and deadline <= utcnow():
            raise ValueError(f"deadline {deadline.isoformat()} has already passed")  # the header's fault, not a field's
    except ValueError as exc:
        raise ApiError(400, f"{DEADLINE_HEADER}: {exc}", code="invalid_value", param=DEADLINE_HEADER) from exc
    return body.model_copy(update={"deadline": deadline})


async def _fit_context(
    tokenizers: ModelTokenizers, inference: InferenceRequest, body: AnyBody, heartbeats: list[WorkerHeartbeat]
) -> tuple[InferenceRequest, int | None]:
    """The prompt counted with the tokenizer the workers published: prompt + ``max_tokens`` over the context is a
    400 now (not an error after a Kafka round trip); a default ``max_tokens`` shrinks to the room left. Without
    a published tokenizer, or for a prompt the template cannot render, the worker decides as before. Returns the
    request and its prompt's tokens (None when not counted)."""
    context = model_context(heartbeats)
    view = await tokenizers.get(inference.model) if context is not None else None
    if view is None:
        return inference, None
    embed = inference.task == "embed"  # prefill only: the prompt alone must fit
    param = "input" if embed else "messages" if inference.messages is not None else "prompt"
    if isinstance(inference.prompt, list):
        view.check_in_vocabulary(inference.prompt, param=param)  # a 400 now, not an error event from the worker
    try:
        prompt_tokens = len(view.encode_request(inference))
    except Exception:  # a template's own refusal: the worker reports it with its own message
        return inference, None
    wanted = 0 if embed else inference.sampling.max_tokens
    explicit = embed or bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    fitted = check_prompt_fits(prompt_tokens, wanted, context, explicit=explicit, param=param)
    if fitted == wanted:
        return inference, prompt_tokens
    sampling = inference.sampling.model_copy(update={"max_tokens": fitted})
    return inference.model_copy(update={"sampling": sampling}), prompt_tokens


def tool_call_format(request: Request) -> ToolCallFormat | None:
    """How the accepted request's model writes tool calls (from its workers' heartbeats), if known."""
    return getattr(request.state, "tool_call_format", None)


@contextmanager
def _request_span(request: Request, endpoint: str) -> Iterator[tuple[Span | None, dict[str, str]]]:
    """The accepted request's span (a child of the HTTP server span) and the trace carrier for its Kafka
    record. While tracing is off there is no span object at all: the caller's ``traceparent`` (or a new
    trace) continues with a new span id, as a string."""
    if not tracing_enabled():
        incoming = request.headers.get(HEADER_TRACEPARENT)
        carrier = {HEADER_TRACEPARENT: child_traceparent(incoming)}
        state = request.headers.get(HEADER_TRACESTATE)
        if incoming and state:
            carrier[HEADER_TRACESTATE] = state
        yield None, carrier
        return
    with tracer_of(request).start_as_current_span(f"ingress {endpoint}", kind=SpanKind.INTERNAL) as span:
        carrier = {}
        propagate.inject(carrier)
        yield span, carrier
