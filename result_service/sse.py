"""Server-Sent Events flavour of the relay: ``id: <entry id>`` plus ``data: <json>`` per event.

Served at ``/v1/streams/{request_id}/sse`` and at ``/v1/streams/{request_id}`` when the client sends
``Accept: text/event-stream``. ``Last-Event-ID`` (what ``EventSource`` sends on reconnect) and
``?last_id=`` both set the resume point. After ``done``/``error`` the response ends; a reconnect
after that gets 204, which tells ``EventSource`` to stop. A dropped slow client ends the response
too, and ``EventSource`` resumes from its last id on its own.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError

from schemas import TraceContext
from sluicegate.stream_subscription import SlowConsumer
from sluicegate.telemetry import tracing_enabled

from .access import AccessDenied, BadStreamRequest, StreamGrant, StreamStatus, authorise, probe
from .context import RelayContext, relay_context

log = logging.getLogger(__name__)

router = APIRouter()

EVENT_STREAM = "text/event-stream"
# Reconnect quickly: the stream is resumable, and tokens are what the user is waiting for.
_PREAMBLE = "retry: 1000\n\n"


async def _events(ctx: RelayContext, grant: StreamGrant, trace: TraceContext | None) -> AsyncIterator[str]:
    yield _PREAMBLE
    keepalive = ctx.hub.config.sse_keepalive_s
    try:
        with ctx.metrics.relaying("sse", grant, trace):
            async with ctx.hub.subscribe(grant.request_id, grant.after_seq, tenant=grant.tenant) as sub:
                while not sub.finished:
                    batch = await sub.next_batch(max_wait_s=keepalive)
                    if not batch:
                        # A comment line: keeps proxies and load balancers from closing an idle response.
                        yield ": keepalive\n\n"
                        continue
                    yield "".join(f"id: {item.entry_id}\ndata: {item.payload}\n\n" for item in batch)
    except SlowConsumer:
        log.info("relay.slow_consumer_dropped request_id=%s transport=sse", grant.request_id)
        ctx.metrics.slow_consumers.labels("sse").inc()
        yield ": client too slow; reconnect with Last-Event-ID to resume\n\n"
    except RedisError as exc:
        log.error("relay.history_failed request_id=%s error=%r", grant.request_id, exc)
        yield ": stream store unavailable; reconnect with Last-Event-ID to resume\n\n"


def _bearer(request: Request) -> str | None:
    """The stream token sent as ``Authorization: Bearer`` (a fetch-based SSE client can set headers; EventSource
    cannot, so ``?token=`` stays the way docs/api.md shows)."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


async def _respond(request: Request, request_id: str, token: str | None, last_ids: list[str | None]) -> Response:
    ctx = relay_context(request)
    try:
        grant = authorise(ctx.settings.stream_token_secret, request_id, token or _bearer(request), *last_ids)
    except AccessDenied as exc:
        # RFC 9110 requires the challenge on a 401; it names the scheme a token is also taken in.
        challenge = 'Bearer realm="sluicegate-stream", error="invalid_token"'
        return JSONResponse({"detail": str(exc)}, status_code=401, headers={"WWW-Authenticate": challenge})
    except BadStreamRequest as exc:
        return JSONResponse({"detail": str(exc)}, status_code=400)
    try:
        status, why, trace = await probe(ctx.hub, ctx.names, grant, want_trace=tracing_enabled())
    except RedisError as exc:
        log.error("relay.probe_failed request_id=%s error=%r", request_id, exc)
        return JSONResponse({"detail": "stream store unavailable"}, status_code=503, headers={"Retry-After": "1"})
    if status is StreamStatus.FINISHED:
        return Response(status_code=204)
    if status is StreamStatus.EXPIRED:
        return JSONResponse({"detail": why}, status_code=404)
    return StreamingResponse(
        _events(ctx, grant, trace),
        media_type=EVENT_STREAM,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/v1/streams/{request_id}/sse", response_class=StreamingResponse)
async def stream_sse(
    request: Request,
    request_id: str,
    token: str | None = Query(None, description="The stream_token returned when the request was submitted."),
    last_id: str | None = Query(None, description="Resume after this entry id."),
    last_event_id: str | None = Header(None, description="Set by EventSource on reconnect."),
) -> Response:
    """Relay one request's stream as Server-Sent Events."""
    return await _respond(request, request_id, token, [last_id, last_event_id])


@router.get("/v1/streams/{request_id}", response_class=StreamingResponse)
async def stream_get(
    request: Request,
    request_id: str,
    token: str | None = Query(None, description="The stream_token returned when the request was submitted."),
    last_id: str | None = Query(None, description="Resume after this entry id."),
    last_event_id: str | None = Header(None, description="Set by EventSource on reconnect."),
) -> Response:
    """The same path as the WebSocket: Server-Sent Events when asked for with ``Accept: text/event-stream``."""
    if EVENT_STREAM not in request.headers.get("accept", ""):
        return JSONResponse(
            {
                "detail": f"/v1/streams/{{request_id}} is a WebSocket endpoint; for Server-Sent Events send "
                f"'Accept: {EVENT_STREAM}' or use /v1/streams/{{request_id}}/sse"
            },
            status_code=406,
        )
    return await _respond(request, request_id, token, [last_id, last_event_id])
