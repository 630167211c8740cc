"""The result service application: WebSocket and SSE relays of Redis streams, and the chat page.

``create_app(settings)`` builds it; its lifespan opens the Redis client, the fan-out hub and the
canceller, and closes them in reverse order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis

from sluicegate.browser_origins import browser_origins
from sluicegate.cancellation import Canceller
from sluicegate.gc_freeze import freeze_startup_heap
from sluicegate.kafka import create_producer
from sluicegate.redis_client import create_redis
from sluicegate.settings import ResultServiceSettings
from sluicegate.task_stop import cancel_and_wait
from sluicegate.telemetry import configure_tracing, instrument_app

from . import page, sse, websocket, websocket_mux
from .context import RelayContext
from .control_producer import ControlProducer
from .hub import RelayConfig, StreamHub
from .telemetry import RelayMetrics


def create_app(
    settings: ResultServiceSettings,
    *,
    config: RelayConfig | None = None,
    redis: Redis | None = None,
    canceller: Canceller | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """The result service for ``settings``; ``freeze_heap`` (for a process that serves only this app) takes
    the startup heap out of the garbage collector's passes.

    ``redis`` and ``canceller`` may be injected (e.g. shared with ingress); injected objects are
    not closed by the app. Raises ``ValueError`` when no stream token secret is configured.
    """
    if not settings.stream_token_secret:
        raise ValueError(
            "the result service needs SLUICEGATE_STREAM_TOKEN_SECRET (the secret ingress signs stream tokens with)"
        )
    config = config or RelayConfig()
    names = settings.names
    configure_tracing("sluicegate-result-service", settings.otlp_endpoint)
    metrics = RelayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis if redis is not None else create_redis(settings, client_name=config.client_name)
        hub = StreamHub(client, names, config)
        cancel = canceller
        control: ControlProducer | None = None
        if cancel is None:
            control = ControlProducer(
                lambda: create_producer(settings, client_id="sluicegate-result-service"),
                names,
                kafka=settings,
                topic_replication=settings.topic_replication,
            )
            cancel = Canceller(
                client,
                names,
                marker_ttl_s=settings.stream_ttl_s,
                service="relay",
                lease=control.lease,
            )
        await hub.start()
        # In the background: relaying never waits for Kafka, but the first Stop should not either.
        warm_up = asyncio.create_task(control.warm_up()) if control is not None else None
        metrics.watch_hub(hub)
        app.state.relay = RelayContext(settings=settings, names=names, hub=hub, canceller=cancel, metrics=metrics)
        if freeze_heap:
            freeze_startup_heap("result-service")
        try:
            yield
        finally:
            await hub.close()
            await cancel_and_wait(warm_up)
            if control is not None:
                await cancel.aclose()
                await control.aclose()
            if redis is None:
                await client.aclose()

    app = FastAPI(
        title="Sluicegate result service",
        description="Relays request token streams from Redis over WebSocket and Server-Sent Events.",
        version="0.1.0",
        lifespan=lifespan,
    )
    # A page that may submit a request to ingress may follow its stream over SSE from the same origin (an
    # EventSource across origins needs these headers; WebSockets do not, their token is the check).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=browser_origins(settings),
        allow_methods=["GET", "HEAD", "OPTIONS"],
        allow_headers=["Authorization", "Last-Event-ID", "Accept"],
    )
    app.include_router(websocket.router)
    app.include_router(websocket_mux.router)
    app.include_router(sse.router)
    app.include_router(page.router)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus metrics of this process (rendered in a thread: never holds the event loop)."""
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.mount("/static", StaticFiles(directory=page.STATIC_DIR), name="static")
    app.add_api_websocket_route("/{path:path}", websocket.no_socket_here)  # last: only what no route above took
    instrument_app(app)
    return app
