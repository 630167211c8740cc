"""Admission, the step every publishing endpoint shares, in one place and in this order:

1. the model: a LoRA adapter's name becomes its base model + the adapter (``sluicegate.lora.resolve``), a routed
   public name one of its versions (``ingress.model_routes``); then the tier (``router.policy.resolve_tier``);
2. the key's limits on the request's size (prompt, ``max_tokens``, a cost its token rate could never allow), the
   model's live workers (404) and their context; the pipeline's :class:`schemas.InferenceRequest` is built
   (``build_request``), its prompt counted with the workers' tokenizer where they publish one;
3. the response cache: a hit is answered from it at once, charged first as step 5 charges (it never meets the
   queue; should Redis refuse its replay, it goes on to a worker already charged);
4. the queue: a deadline passed or one its workers' backlog cannot meet, a model backlog at its bound;
5. the charge: the key's rate limits, then the token quota reservation. Only now, so a request the queue turns
   away costs its key nothing;
6. record + publish, one step (:meth:`IngressService.publish`), under a span whose context travels in the Kafka
   headers.

:func:`accept` returns an :class:`Accepted`: the request and what its route answers with (tool-call format, rate
headers, the prompt ingress counted). A refusal is an ``ApiError`` whose ``x-request-id`` is the call's request id
(:func:`ingress.errors.answered_under`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from fastapi import Request
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind
from pydantic import ValidationError
from redis.exceptions import RedisError

from router.policy import deadline_unmeetable, resolve_tier
from schemas import InferenceRequest, ReasoningParser, Tier, ToolCallFormat, TraceContext, WorkerHeartbeat, utcnow
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
from sluicegate.api.openai_format import worker_failure
from sluicegate.api.prompt_tokens import ModelTokenizers, check_prompt_fits
from sluicegate.api.reasoning import advertised_reasoning_parser
from sluicegate.telemetry import child_traceparent, genai_operation, genai_request_attributes, tracing_enabled
from sluicegate.usage.quota import QuotaClaim, claim_for

from .app_state import service_of, tracer_of
from .auth import ApiKey
from .errors import answered_under, unavailable
from .ratelimit import RateState
from .service import IngressService
from .telemetry import IngressMetrics
from .usage_ledger import cache_hit_record

# The statuses accepting a request can answer (documented on every publishing endpoint); 504: its deadline passed
# while it was being accepted.
SUBMIT_ERRORS = (400, 401, 404, 413, 429, 503, 504)


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request admitted and queued (or answered from the response cache), with what its route answers with."""

    inference: InferenceRequest
    # How the model writes tool calls, from its workers' heartbeats (None: not advertised).
    tool_call_format: ToolCallFormat | None
    # What the key's rate limits had left once this request was charged (None: the key has none).
    rate: RateState | None
    # The prompt's exact tokens, counted with the model's tokenizer (None: not counted), for the running usage of
    # a ``continuous_usage_stats`` stream.
    counted_prompt_tokens: int | None
    # How the model's output splits into reasoning and answer, from its workers' heartbeats (None: all answer).
    reasoning_parser: ReasoningParser | None = None

    @property
    def request_id(self) -> str:
        """The accepted request's id."""
        return self.inference.request_id


def new_request_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


async def accept(request: Request, caller: ApiKey, body: AnyBody, endpoint: str, *, relayed: bool = True) -> Accepted:
    """Admit ``body`` as the one request of this HTTP call (:func:`admit`); a refusal names the request's id."""
    request_id = new_request_id()
    with answered_under(request_id):
        return await admit(request, caller, body, endpoint, request_id=request_id, relayed=relayed)


async def admit(
    request: Request, caller: ApiKey, body: AnyBody, endpoint: str, *, request_id: str, relayed: bool = True
) -> Accepted:
    """Check, charge, record and publish one request (the module's steps, in order); its id is the caller's (a
    call of several requests, :mod:`ingress.fan_out`, names them all up front). ``relayed``: only this HTTP
    response carries the output, and its client cannot resume it, so the request names this instance's reader
    lease (its workers stop it if this instance dies).

    400, 404 and 429 for a request refused (nothing is charged for one refused before step 5), 504 for a deadline
    that passed on the way; 503 when Kafka or Redis fails."""
    service = service_of(request)
    body = _with_header_deadline(body, request.headers.get(DEADLINE_HEADER))
    accepted_at = time.perf_counter()
    # 1. The model. An adapter's name (visible to this tenant) is its base model + the adapter, from a cached
    # snapshot of the registry (no Redis round trip here); any other name is left to the model checks (their 404).
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
    # 2. Its size against the key's limits, then the model's live workers and their context.
    limits = caller.limits.resolve(service.settings)
    prompt_tokens = check_prompt_tokens(body, limits)
    max_tokens = checked_max_tokens(body, limits)
    tokens = prompt_tokens + max_tokens  # what the key's token rate is charged
    check_rate_cost(tokens, limits)
    heartbeats = await service.model_heartbeats(body.model)
    max_tokens = check_context(body, max_tokens, model_context(heartbeats))
    tool_call_format = advertised_tool_call_format(heartbeats)
    reasoning_parser = advertised_reasoning_parser(heartbeats)
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
        counted: int | None = None
        prompt_ids: list[int] | None = None  # as the worker will see them: routing on the cached prefix hashes them
        if service.settings.ingress_count_prompt_tokens:
            inference, prompt_ids = await _fit_context(service.tokenizers, inference, body, heartbeats)
            counted = len(prompt_ids) if prompt_ids is not None else None
        quota = claim_for(inference, service.settings, key_id=caller.key_id, key_limits=limits, prompt_tokens=counted)
        if span is not None:
            span.update_name(f"{genai_operation(inference)} {inference.model}")
            span.set_attributes(genai_request_attributes(inference))
        # 3. The response cache.
        cache_key, lookup = service.cache.plan(inference, request.headers.get("cache-control"))
        cached = await service.cache.lookup(inference, cache_key) if lookup and cache_key is not None else None
        rate: RateState | None = None
        charged = False
        if cached is not None:
            # No GPU, but the key still pays for the call; first, so a 429 leaves nothing behind.
            rate = await _charge(service, caller.key_id, limits, tokens, quota)  # the quota settles from the record
            charged = True
            if await service.cache.replay(inference, cached):
                if (record := cache_hit_record(inference, cached.events)) is not None:
                    service.usage.send_later(record)
                if span is not None:
                    span.set_attribute("sluicegate.route_reason", "response_cache")
                return Accepted(inference, tool_call_format, rate, counted, reasoning_parser)
            # Redis did not take the replay: a worker answers it, already charged.
        # 4. The queue.
        cacheable = prompt_ids if inference.task != "embed" else None  # an embedding neither uses nor fills a cache
        # An adapter's registry id seeds its KV chain: with it the router hashes the prompt as the engine does.
        lora_int_id = await service.adapters.lora_int_id(adapter) if adapter and cacheable is not None else None
        route = await service.route(
            inference, max_tier=caller.max_tier, heartbeats=heartbeats, prompt_ids=cacheable, lora_int_id=lora_int_id
        )
        _check_deadline(service.metrics, inference, route.tier, heartbeats)
        await service.backlog.admit(inference.model, route.tier, heartbeats, service.partitions(inference.model))
        # 5. The charge, once the queue has room for the request.
        if not charged:
            rate = await _charge(service, caller.key_id, limits, tokens, quota)
        # 6. Recorded and published, one step.
        published = await service.publish(inference, route, carrier)
        service.backlog.accepted(inference.model, route.tier, published.topic, published.partition, published.offset)
        if cache_key is not None:
            service.cache.fill_later(inference, cache_key)
        if version is not None:
            service.routes.observe(version, inference.request_id, inference.tenant, accepted_at)
        if span is not None:
            span.set_attributes({"messaging.destination.name": route.topic, "sluicegate.route_reason": route.reason})
    return Accepted(inference, tool_call_format, rate, counted, reasoning_parser)


def rate_headers(*accepted: Accepted) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the answer to the ``accepted`` requests of one call: what the
    caller's rate limits had left once they were charged; none when the key has no limits. Several requests are
    charged concurrently and their answers come back in any order: the headers give the least any of them left."""
    kept: RateState | None = None
    for each in accepted:
        if each.rate is not None:
            kept = each.rate if kept is None else kept.tightest(each.rate)
    return kept.headers() if kept is not None else {}


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
) -> tuple[InferenceRequest, list[int] | None]:
    """The prompt counted with the tokenizer the workers published: prompt + ``max_tokens`` over the context is a
    400 now (not an error after a Kafka round trip); a default ``max_tokens`` shrinks to the room left. Without
    a published tokenizer, or for a prompt the template cannot render, the worker decides as before. Returns the
    request and its prompt's token ids (None when not counted)."""
    context = model_context(heartbeats)
    view = await tokenizers.get(inference.model) if context is not None else None
    if view is None:
        return inference, None
    embed = inference.task == "embed"  # prefill only: the prompt alone must fit
    param = "input" if embed else "messages" if inference.messages is not None else "prompt"
    if isinstance(inference.prompt, list):
        view.check_in_vocabulary(inference.prompt, param=param)  # a 400 now, not an error event from the worker
    try:
        prompt_ids = view.encode_request(inference)
    except Exception:  # a template's own refusal: the worker reports it with its own message
        return inference, None
    wanted = 0 if embed else inference.sampling.max_tokens
    explicit = embed or bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    prompt_tokens = len(prompt_ids)
    fitted = check_prompt_fits(prompt_tokens, wanted, context, explicit=explicit, param=param)
    if fitted == wanted:
        return inference, prompt_ids
    sampling = inference.sampling.model_copy(update={"max_tokens": fitted})
    return inference.model_copy(update={"sampling": sampling}), prompt_ids


def _check_deadline(
    metrics: IngressMetrics, request: InferenceRequest, tier: Tier, heartbeats: list[WorkerHeartbeat]
) -> None:
    """504 ``deadline_exceeded`` for a deadline that passed while the request was checked (a deadline of a few ms:
    answered as the worker would, not queued); 429 ``deadline_unmeetable`` when the backlog the model's workers
    report at ``tier`` and above cannot be worked off before it."""
    if request.expired():
        metrics.rejected.labels("deadline_exceeded").inc()
        assert request.deadline is not None
        message = f"The deadline {request.deadline.isoformat()} passed before the request was queued."
        raise worker_failure("deadline_exceeded", message)
    if (unmeetable := deadline_unmeetable(request, tier, heartbeats)) is not None:
        metrics.rejected.labels("deadline_unmeetable").inc()
        # Retrying cannot bring the deadline back: the SDKs are told not to.
        headers = {"x-should-retry": "false"}
        raise ApiError(429, f"{unmeetable}; nothing was queued.", code="deadline_unmeetable", headers=headers)


async def _charge(
    service: IngressService, key_id: str, limits: Limits, tokens: int, quota: QuotaClaim | None
) -> RateState | None:
    """Charge one request of ``tokens`` to the key's rate limits, then reserve its tokens under its quotas
    (``quota``). Returns what the rate limits have left (None without any); 429 over a limit (nothing charged) or a
    quota (``insufficient_quota``), 503 without Redis."""
    try:
        rate = await service.rate_limiter.acquire(key_id, limits, tokens=tokens)
    except ApiError:
        service.metrics.rejected.labels("rate_limited").inc()
        raise
    except (RedisError, OSError) as exc:
        raise unavailable("Redis", exc) from exc
    if quota is None:
        return rate
    try:
        refusal = await service.quotas.reserve(quota)
    except (RedisError, OSError) as exc:
        raise unavailable("Redis", exc) from exc
    if refusal is not None:
        service.metrics.rejected.labels("insufficient_quota").inc()
        raise refusal.error()
    return rate


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
