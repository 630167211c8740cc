"""The ingress FastAPI app: OpenAI-compatible completions, the native submit/status/cancel API, model
listing, health and metrics. ``create_app(settings)`` builds it; ``serve(settings)`` runs it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import anyio
from fastapi import Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Tracer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from router.policy import resolve_tier
from schemas import InferenceRequest, RequestRecord, TraceContext, utcnow
from schemas.names import HEADER_TRACEPARENT, HEADER_TRACESTATE
from sluicegate.heap import freeze_startup_heap
from sluicegate.settings import Settings
from sluicegate.stream_tokens import issue_stream_token

from .assembler import StreamAssembler
from .auth import ApiKey, KeyRing, presented_key
from .bodies import AnyBody, ChatCompletionBody, CompletionBody, NativeRequestBody, build_request
from .errors import ApiError, error_body, install_error_handlers, invalid
from .lean_route import LeanRoute
from .limits import check_prompt_tokens, check_rate_cost, checked_max_tokens
from .openai_format import ERROR_STATUS, SSE_DONE, Kind, ResponseIds, sse
from .openapi import (
    CancelResponse,
    ChatCompletion,
    Health,
    ModelCard,
    ModelList,
    Readiness,
    SubmitResponse,
    TextCompletion,
    errors,
    install_openapi,
    json_body,
    ok,
    plain_text,
)
from .service import IngressService
from .telemetry import IngressMetrics, MetricsMiddleware, build_tracer_provider

log = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)
E = TypeVar("E", bound=Callable[..., Any])

# Same alphabet as schemas' RequestId: anything else cannot name a request.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ANONYMOUS = ApiKey(key_hash="0" * 64, tenant="default")
# Statuses of accepting a request, and of waiting for its result (OpenAI endpoints only).
_SUBMIT_ERRORS = (400, 401, 404, 413, 422, 429, 503)
_RESULT_ERRORS = (409, 500, 504)


class BodyLimitMiddleware:
    """413 for bodies over the caller's limit (its key's ``max_body_bytes``, else ``max_bytes``): at once from
    ``Content-Length``, or as soon as a streamed (chunked) body grows past it."""

    def __init__(self, app: ASGIApp, max_bytes: int, keyring: KeyRing | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.keyring = keyring

    def limit_for(self, scope: Scope) -> int:
        """The body limit of the key the request presents (the default for none or an unknown one)."""
        if self.keyring is None:
            return self.max_bytes
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in (b"authorization", b"x-api-key")
        }
        presented = presented_key(headers)
        key = self.keyring.lookup(presented) if presented else None
        if key is None or key.limits.max_body_bytes is None:
            return self.max_bytes
        return key.limits.max_body_bytes

    @staticmethod
    def _too_large(limit: int) -> ApiError:
        return ApiError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    bad = ApiError(400, "Invalid Content-Length header.", code="invalid_header")
                    await bad.response()(scope, receive, send)
                    return
                if int(value) > limit:
                    await self._too_large(limit).response()(scope, receive, send)
                    return
        received = 0

        async def limited() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the endpoint's body read, so the app's error handler answers it.
                    raise self._too_large(limit)
            return message

        await self.app(scope, limited, send)


def _state(request: Request) -> IngressService:
    service: IngressService = request.app.state.service
    return service


def create_app(settings: Settings, *, freeze_heap: bool = False) -> FastAPI:
    """The ingress app for ``settings``; connects to Kafka and Redis lazily, on first use. ``freeze_heap``
    (for a process that serves only this app) takes the startup heap out of the garbage collector's passes.

    Raises ``ValueError`` for a configuration that cannot serve: no API keys (unless
    ``allow_anonymous``) or no stream token secret.
    """
    keyring = KeyRing.load(settings.api_keys, settings.api_keys_file)
    if not keyring and not settings.allow_anonymous:
        raise ValueError(
            "no API keys configured: set SLUICEGATE_API_KEYS or SLUICEGATE_API_KEYS_FILE "
            "(or SLUICEGATE_ALLOW_ANONYMOUS=true for a local demo)"
        )
    if not settings.stream_token_secret:
        raise ValueError("SLUICEGATE_STREAM_TOKEN_SECRET is empty: ingress needs it to issue stream tokens")
    metrics = IngressMetrics()
    tracer_provider = build_tracer_provider("sluicegate-ingress", settings.otlp_endpoint)
    tracer = tracer_provider.get_tracer("sluicegate.ingress")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = IngressService(settings, metrics)
        app.state.service = service
        # Connect to Kafka in the background so the first request does not pay for it; a failure here is
        # retried by the first publish.
        warmup = asyncio.create_task(_warm_up(service))
        if freeze_heap:
            freeze_startup_heap("ingress")
        try:
            yield
        finally:
            warmup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await warmup
            await service.close()
            tracer_provider.shutdown()

    app = FastAPI(
        title="Sluicegate ingress",
        summary="OpenAI-compatible and native API in front of a Kafka-queued LLM pipeline.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.keyring = keyring
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors_origins(settings),
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["authorization", "content-type", "x-api-key", HEADER_TRACEPARENT, HEADER_TRACESTATE],
        expose_headers=["x-request-id"],
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, keyring=keyring)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    _add_routes(app, settings, tracer, metrics)
    install_openapi(app)
    return app


def cors_origins(settings: Settings) -> list[str]:
    """Origins whose pages may call ingress: the result service (which serves the chat page) on the local
    hosts and at its public address, plus ``cors_origins``."""
    origins = [f"http://{host}:{settings.result_port}" for host in ("127.0.0.1", "localhost")]
    public = urlsplit(settings.public_stream_url)
    if public.scheme in ("ws", "wss", "http", "https") and public.netloc:
        origins.append(f"{'https' if public.scheme in ('wss', 'https') else 'http'}://{public.netloc}")
    origins += [o.strip().rstrip("/") for o in settings.cors_origins.split(",") if o.strip()]
    return list(dict.fromkeys(origins))


async def _warm_up(service: IngressService) -> None:
    try:
        await service.producers.start()
    except Exception as exc:
        log.warning("ingress.kafka_not_ready error=%r; will retry on first publish", exc)


async def authenticate(request: Request) -> ApiKey:
    """The caller's API key; 401 in OpenAI's shape without a valid one.

    Async on purpose: FastAPI runs a plain-function dependency in its thread pool on every request.
    """
    presented = presented_key(request.headers)
    if presented is None:
        if request.app.state.settings.allow_anonymous:
            return _ANONYMOUS
        raise ApiError(
            401,
            "Missing API key: pass it as 'Authorization: Bearer <key>' or in the 'x-api-key' header.",
            code="invalid_api_key",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    key = request.app.state.keyring.lookup(presented)
    if key is None:
        raise ApiError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return key


Caller = Annotated[ApiKey, Depends(authenticate)]


async def parse_body(request: Request, model: type[B], *, root_field: str) -> B:
    """The JSON body validated as ``model``: 400 for malformed JSON, 422/400 naming the bad field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(422, "Request body must be a JSON object.", code="invalid_value")
    if b"\\u" in raw and _has_lone_surrogate(data):
        raise ApiError(
            400,
            "Request body is not valid JSON text: a \\u escape encodes an unpaired UTF-16 surrogate, which is not "
            "a character.",
            code="invalid_json",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, root_field=root_field) from exc


def _add_routes(app: FastAPI, settings: Settings, tracer: Tracer, metrics: IngressMetrics) -> None:
    async def accept(request: Request, caller: ApiKey, body: AnyBody, endpoint: str) -> InferenceRequest:
        """Check the model, build the pipeline request and publish it under a span whose context travels
        in the Kafka headers."""
        service = _state(request)
        tier = resolve_tier(body.priority, default_tier=caller.default_tier, max_tier=caller.max_tier)
        limits = caller.limits.resolve(settings)
        prompt_tokens = check_prompt_tokens(body, limits)
        max_tokens = checked_max_tokens(body, limits)
        check_rate_cost(prompt_tokens + max_tokens, limits)
        heartbeats = await service.model_heartbeats(body.model)
        parent = propagate.extract(dict(request.headers))
        with tracer.start_as_current_span(f"ingress {endpoint}", context=parent, kind=SpanKind.SERVER) as span:
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

    # --- OpenAI-compatible ----------------------------------------------------------------------
    async def openai_call(
        request: Request, caller: ApiKey, body: ChatCompletionBody | CompletionBody, kind: Kind
    ) -> Response:
        accepted_at = time.perf_counter()
        inference = await accept(request, caller, body, f"/v1/{'chat/' if kind == 'chat' else ''}completions")
        ids = ResponseIds(kind, inference.request_id, inference.model, int(time.time()))
        headers = {"x-request-id": inference.request_id}
        service = _state(request)
        if body.stream:
            stream = _sse_events(
                service,
                ids,
                tenant=inference.tenant,
                include_usage=body.include_usage,
                accepted_at=accepted_at,
                metrics=metrics,
            )
            headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        assembler = await _collect_or_cancel(request, service, inference.request_id, inference.tenant)
        if assembler is None:
            # The client left; nobody reads this, 499 is for logs and metrics.
            return Response(status_code=499)
        failure = _failure(assembler)
        if failure is not None:
            raise failure
        assert assembler.done is not None
        payload = ids.response(assembler.text, assembler.done.finish_reason, assembler.done.usage)
        return JSONResponse(payload, headers=headers)

    def publishing(path: str, **options: Any) -> Callable[[E], E]:
        """Register a POST endpoint that publishes requests: it authenticates and parses its body itself, on
        ``LeanRoute`` (see ingress.lean_route).

        Added to the app's own router rather than through an ``APIRouter(route_class=LeanRoute)``: FastAPI
        dispatches an included router through one more routing layer on every request."""

        def register(endpoint: E) -> E:
            app.router.add_api_route(path, endpoint, methods=["POST"], route_class_override=LeanRoute, **options)
            return endpoint

        return register

    @publishing(
        "/v1/chat/completions",
        tags=["openai"],
        openapi_extra=json_body(ChatCompletionBody),
        responses=ok(ChatCompletion, stream=True) | errors(*_SUBMIT_ERRORS, *_RESULT_ERRORS),
    )
    async def chat_completions(request: Request) -> Response:
        caller = await authenticate(request)
        body = await parse_body(request, ChatCompletionBody, root_field="messages")
        return await openai_call(request, caller, body, "chat")

    @publishing(
        "/v1/completions",
        tags=["openai"],
        openapi_extra=json_body(CompletionBody),
        responses=ok(TextCompletion, stream=True) | errors(*_SUBMIT_ERRORS, *_RESULT_ERRORS),
    )
    async def completions(request: Request) -> Response:
        caller = await authenticate(request)
        body = await parse_body(request, CompletionBody, root_field="prompt")
        return await openai_call(request, caller, body, "completion")

    @publishing(
        "/v1/requests",
        status_code=202,
        tags=["native"],
        openapi_extra=json_body(NativeRequestBody),
        responses=ok(SubmitResponse, status=202) | errors(*_SUBMIT_ERRORS),
    )
    async def submit(request: Request) -> JSONResponse:
        caller = await authenticate(request)
        body = await parse_body(request, NativeRequestBody, root_field="prompt")
        inference = await accept(request, caller, body, "/v1/requests")
        rid = inference.request_id
        payload = {
            "request_id": rid,
            "status": "queued",
            "model": inference.model,
            "priority": inference.priority,
            "stream_url": f"{settings.public_stream_url.rstrip('/')}/v1/streams/{rid}",
            "stream_token": issue_stream_token(settings.stream_token_secret, rid, inference.tenant),
        }
        return JSONResponse(payload, status_code=202, headers={"x-request-id": rid})

    @app.get("/v1/models", tags=["openai"], responses=ok(ModelList) | errors(401, 503))
    async def list_models(request: Request, caller: Caller) -> dict[str, Any]:
        models = await _state(request).live_models()
        return {"object": "list", "data": [_model_card(name, beats) for name, beats in models.items()]}

    @app.get("/v1/models/{model:path}", tags=["openai"], responses=ok(ModelCard) | errors(401, 404, 503))
    async def get_model(request: Request, caller: Caller, model: str) -> dict[str, Any]:
        models = await _state(request).live_models()
        if model not in models:
            raise ApiError(
                404, f"The model '{model}' does not exist or has no live worker.", code="model_not_found", param="model"
            )
        return _model_card(model, models[model])

    # --- native -----------------------------------------------------------------------------------
    async def owned_record(request: Request, caller: ApiKey, request_id: str) -> RequestRecord:
        record = await _state(request).record(request_id) if _valid_id(request_id) else None
        # Another tenant's request is indistinguishable from a missing one.
        if record is None or record.tenant != caller.tenant:
            raise ApiError(404, f"No request '{request_id}'.", code="request_not_found", param="request_id")
        return record

    @app.get("/v1/requests/{request_id}", tags=["native"], responses=ok(RequestRecord) | errors(401, 404, 503))
    async def request_status(request: Request, caller: Caller, request_id: str) -> JSONResponse:
        record = await owned_record(request, caller, request_id)
        return JSONResponse(record.model_dump(mode="json"))

    @app.delete(
        "/v1/requests/{request_id}",
        status_code=202,
        tags=["native"],
        responses=ok(CancelResponse, status=202) | errors(401, 404, 409, 503),
    )
    async def cancel_request(request: Request, caller: Caller, request_id: str) -> JSONResponse:
        record = await owned_record(request, caller, request_id)
        if record.status in ("finished", "failed"):
            raise ApiError(409, f"Request '{request_id}' already {record.status}.", code="request_finished")
        await _state(request).cancel(request_id, caller.tenant, reason="client_cancelled")
        return JSONResponse({"request_id": request_id, "status": "cancelling"}, status_code=202)

    # --- operations ------------------------------------------------------------------------------
    @app.get("/healthz", tags=["ops"], responses=ok(Health))
    async def healthz(request: Request) -> dict[str, Any]:
        service = _state(request)
        return {"status": "ok", "kafka_producer": "started" if service.producers.started else "not_started"}

    @app.get("/readyz", tags=["ops"], responses=ok(Readiness) | ok(Readiness, status=503))
    async def readyz(request: Request) -> JSONResponse:
        service = _state(request)
        problems: dict[str, str] = {}
        try:
            await service.redis.ping()
        except (RedisError, OSError) as exc:
            problems["redis"] = f"Redis is unavailable: {str(exc) or type(exc).__name__}"
        try:
            await service.producers.start()
        except Exception as exc:
            problems["kafka"] = f"Kafka is unavailable: {str(exc) or type(exc).__name__}"
        return JSONResponse(
            {"status": "ok" if not problems else "unavailable", **problems}, status_code=503 if problems else 200
        )

    @app.get(
        "/metrics",
        tags=["ops"],
        response_class=Response,
        responses=plain_text("Prometheus metrics in the text exposition format."),
    )
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _has_lone_surrogate(data: Any) -> bool:
    """Whether decoded JSON holds an unpaired surrogate (from an escape like ``\\ud800``); such a string cannot
    be encoded as UTF-8 for Kafka or Redis."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _valid_id(request_id: str) -> bool:
    return _REQUEST_ID.fullmatch(request_id) is not None


def _model_card(name: str, beats: list[Any]) -> dict[str, Any]:
    created = min((int(b.sent_at.timestamp()) for b in beats), default=int(time.time()))
    return {"id": name, "object": "model", "created": created, "owned_by": "sluicegate", "workers": len(beats)}


def _failure(assembler: StreamAssembler) -> ApiError | None:
    """The error to answer for a stream that ended badly, or None."""
    if assembler.error is not None:
        code = assembler.error.code
        return ApiError(ERROR_STATUS.get(code, 500), assembler.error.message, code=code)
    if assembler.done is not None and assembler.done.finish_reason == "error":
        return ApiError(500, "The request failed on the worker.", code="worker_error")
    return None


async def _collect_or_cancel(
    request: Request, service: IngressService, request_id: str, tenant: str
) -> StreamAssembler | None:
    """Wait for the whole result; cancel the request when the client leaves (returns None) or the
    request timeout passes (504)."""

    async def collect() -> StreamAssembler:
        assembler = StreamAssembler()
        async for event in service.events(request_id, timeout_s=service.settings.request_timeout_s):
            assembler.feed(event)
        return assembler

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.create_task(collect())
    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not result.done():
            result.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    if not result.done() or result.cancelled():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await result
        await service.cancel(request_id, tenant, reason="client_disconnected")
        return None
    try:
        return result.result()
    except TimeoutError as exc:
        await service.cancel(request_id, tenant, reason="timeout")
        raise ApiError(504, str(exc), code="timeout") from exc


async def _sse_events(
    service: IngressService,
    ids: ResponseIds,
    *,
    tenant: str,
    include_usage: bool,
    accepted_at: float,
    metrics: IngressMetrics,
) -> AsyncIterator[str]:
    """OpenAI server-sent events for one request; cancels it when the client goes away mid-stream (or the
    relay cannot go on)."""
    cancel_reason: str | None = "client_disconnected"
    first_text = True
    try:
        if ids.kind == "chat":
            yield sse(ids.chunk(role=True, include_usage=include_usage))
        assembler = StreamAssembler()
        try:
            async for event in service.events(ids.request_id, timeout_s=service.settings.request_timeout_s):
                delta = assembler.feed(event)
                if assembler.diverged:
                    cancel_reason = "stream_diverged"
                    message = "The worker restarted this request and produced different text."
                    yield sse(error_body(message, type_="server_error", code="stream_diverged"))
                    return
                if delta:
                    if first_text:
                        metrics.time_to_first_token.labels(ids.model).observe(time.perf_counter() - accepted_at)
                        first_text = False
                    yield sse(ids.chunk(text=delta, include_usage=include_usage))
        except TimeoutError as exc:
            cancel_reason = "timeout"
            yield sse(error_body(str(exc), type_="server_error", code="timeout"))
            return
        except ApiError as exc:
            cancel_reason = "relay_failed"
            yield sse(exc.body())
            return
        cancel_reason = None
        failure = _failure(assembler)
        if failure is not None:
            yield sse(failure.body())
            return
        assert assembler.done is not None
        yield sse(ids.chunk(finish_reason=assembler.done.finish_reason, include_usage=include_usage))
        if include_usage:
            yield sse(ids.usage_chunk(assembler.done.usage))
        yield SSE_DONE
    finally:
        if cancel_reason is not None:
            # Free the worker. Shielded, because after a disconnect this runs inside the response's
            # cancelled scope, where any unshielded await would be cancelled at once.
            with anyio.CancelScope(shield=True), anyio.move_on_after(service.settings.kafka_timeout_s + 1):
                try:
                    await service.cancel(ids.request_id, tenant, reason=cancel_reason)
                except Exception as exc:
                    log.warning("ingress.cancel_failed request_id=%s error=%r", ids.request_id, exc)


def _server(settings: Settings) -> Any:
    import uvicorn

    config = uvicorn.Config(
        create_app(settings, freeze_heap=True),
        host=settings.ingress_host,
        port=settings.ingress_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return uvicorn.Server(config)


async def serve_async(settings: Settings) -> None:
    """Run ingress on the current event loop until the server is told to exit (SIGINT/SIGTERM)."""
    log.info("ingress.starting host=%s port=%d", settings.ingress_host, settings.ingress_port)
    await _server(settings).serve()


def serve(settings: Settings) -> None:
    """Run ingress with uvicorn on ``settings.ingress_host:ingress_port`` until interrupted (blocking).

    ``Server.run`` sets up uvicorn's event loop (uvloop when installed), which ``asyncio.run`` would
    not: measured POST p99 17.9 -> 14.9 ms and less CPU per request.
    """
    log.info("ingress.starting host=%s port=%d", settings.ingress_host, settings.ingress_port)
    _server(settings).run()
