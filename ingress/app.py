"""The ingress FastAPI app, assembled: configuration checks, lifespan (the service and its Kafka warm-up),
middleware, error handlers, the routes of :mod:`ingress.routes` and the OpenAPI document. ``create_app(settings)``
builds it; :mod:`ingress.server` runs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from sluicegate.batches.files import FileStore
from sluicegate.batches.store import BatchStore
from sluicegate.browser_origins import browser_origins
from sluicegate.gc_freeze import freeze_startup_heap
from sluicegate.settings import IngressSettings
from sluicegate.task_stop import cancel_and_wait
from sluicegate.telemetry import configure_tracing, instrument_app, instrument_celery, tracer

from .auth import KeyRing
from .body_limit import BodyLimitMiddleware
from .errors import install_error_handlers
from .openapi import install_openapi
from .ratelimit import RATE_LIMIT_HEADERS
from .responses.store import ResponseStore
from .responses.sweeper import ResponseSweeper
from .route_without_dependencies import LeanRoute
from .routes import adapters, batches, embeddings, files, native, openai, ops, responses, tokenize, usage
from .service import IngressService
from .telemetry import IngressMetrics, MetricsMiddleware

log = logging.getLogger(__name__)


#: Response headers a browser page may read (CORS exposes none beyond the basic ones unless listed): the request's
#: id (and each prompt's), how long to wait after a 429 or 503, whether to retry, when a quota resets, and what the
#: key's rate limits have left.
EXPOSED_HEADERS = (
    "x-request-id",
    "x-request-ids",
    "retry-after",
    "x-should-retry",
    "x-quota-reset",
    *RATE_LIMIT_HEADERS,
)


def create_app(settings: IngressSettings, *, freeze_heap: bool = False) -> FastAPI:
    """The ingress app for ``settings``; connects to Kafka and Redis lazily, on first use. ``freeze_heap``
    (for a process that serves only this app) takes the startup heap out of the garbage collector's passes.

    Raises ``ValueError`` for a configuration that cannot serve: no API keys (unless
    ``allow_anonymous``) or no stream token secret.
    """
    keyring = KeyRing.load(settings.api_keys, settings.api_keys_file, settings.admin_api_keys)
    if not keyring and not settings.allow_anonymous:
        raise ValueError(
            "no API keys configured: set SLUICEGATE_API_KEYS or SLUICEGATE_API_KEYS_FILE "
            "(or SLUICEGATE_ALLOW_ANONYMOUS=true for a local demo)"
        )
    if not settings.stream_token_secret:
        raise ValueError("SLUICEGATE_STREAM_TOKEN_SECRET is empty: ingress needs it to issue stream tokens")
    metrics = IngressMetrics()
    configure_tracing("sluicegate-ingress", settings.otlp_endpoint)
    instrument_celery()  # a batch's first step is a Celery task sent from here: its trace continues there

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = IngressService(settings, metrics)
        app.state.service = service
        service.routes.start()  # watch the routing file for changes
        service.reader.start()
        if service.kv_follower is not None:
            service.kv_follower.start()  # what the workers' KV caches hold, for routing on the cached prefix
        app.state.files = FileStore(settings, service.redis, service.names)
        app.state.batches = BatchStore(settings, service.redis, service.names)
        app.state.responses = ResponseStore(settings, service.redis, service.names)
        sweeper = ResponseSweeper(service, app.state.responses)  # saves stored responses nobody reads
        sweeper.start()
        # Connect to Kafka in the background so the first request does not pay for it; a failure here is
        # retried by the first publish.
        warmup = asyncio.create_task(_warm_up(service))
        if freeze_heap:
            freeze_startup_heap("ingress")
        try:
            yield
        finally:
            await cancel_and_wait(warmup)
            await sweeper.close()
            await service.close()

    app = FastAPI(
        title="Sluicegate ingress",
        summary="OpenAI-compatible and native API in front of a Kafka-queued LLM pipeline.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.keyring = keyring
    app.state.metrics = metrics
    app.state.tracer = tracer("sluicegate.ingress")
    install_error_handlers(app)
    # A multipart upload carries the file plus a few hundred bytes of framing and the purpose field.
    upload_limit = settings.batch_max_file_bytes + 64 * 1024
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        keyring=keyring,
        path_limits={"/v1/files": upload_limit},
    )
    # Added after the body limit, so it wraps it: a 413 carries the CORS headers too, and a browser page reads it
    # instead of an opaque network error. Any request header is allowed from an allowed origin: the API's own
    # (X-Request-Deadline, Cache-Control) and what SDKs add (the openai JS SDK's x-stainless-*, OpenAI-Beta).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=browser_origins(settings),
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=list(EXPOSED_HEADERS),
    )
    if settings.metrics_enabled:
        app.add_middleware(MetricsMiddleware, metrics=metrics)
    routers = (
        openai.router,
        embeddings.router,
        native.router,
        ops.router,
        files.router,
        batches.router,
        tokenize.router,
        responses.router,
        usage.router,
        adapters.router,
    )
    _add_routes(app, routers)
    install_openapi(app)
    instrument_app(app)  # outermost: the server span covers the middleware too
    return app


async def _warm_up(service: IngressService) -> None:
    try:
        await service.producers.start()
    except Exception as exc:
        log.warning("ingress.kafka_not_ready error=%r; will retry on first publish", exc)


def _add_routes(app: FastAPI, routers: tuple[APIRouter, ...]) -> None:
    """Put the routers' routes on the app's own router, the publishing (``LeanRoute``) ones first.

    Not ``app.include_router``: FastAPI dispatches an included router through one more routing layer on
    every request (measured in-process on a bare LeanRoute POST: 18 -> 26 us), which the ``LeanRoute``
    endpoints exist to avoid. Starlette tries routes in order, so the publishing endpoints, the busy ones,
    come first (a stable sort keeps each router's own order); this is also the order of the OpenAPI
    document's paths.
    """
    routes = [route for router in routers for route in router.routes]
    app.router.routes.extend(sorted(routes, key=lambda route: not isinstance(route, LeanRoute)))
