"""``/v1/streams/{request_id}`` over WebSocket: one JSON event per message, then a normal close.

Close codes: 1000 after ``done``/``error`` (or when the client already has them), 1008 for a
missing or wrong token or malformed input, 1013 when the client fell too far behind (reconnect with
``last_id``, nothing is lost), 4404 when the request ended and its stream expired. Protocol-level
pings (uvicorn's ``ws_ping_interval``) keep idle connections alive while a request waits in Kafka.
The only message a client may send is ``{"type": "cancel"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, WebSocket
from redis.exceptions import RedisError
from starlette.websockets import WebSocketDisconnect

from sluicegate import json_input
from sluicegate.stream_subscription import SlowConsumer, Subscription
from sluicegate.task_stop import cancel_and_wait
from sluicegate.telemetry import tracing_enabled

from .access import AccessDenied, BadStreamRequest, StreamGrant, StreamStatus, authorise, probe
from .context import RelayContext, relay_context
from .wire import Relayed

log = logging.getLogger(__name__)

router = APIRouter()

CLOSE_NORMAL = 1000
CLOSE_POLICY_VIOLATION = 1008
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_STREAM_GONE = 4404
#: The close code for a probe that finds nothing left to relay.
ENDED_CLOSE_CODES = {StreamStatus.FINISHED: CLOSE_NORMAL, StreamStatus.EXPIRED: CLOSE_STREAM_GONE}
# RFC 6455 caps the close reason at 123 bytes.
_MAX_REASON = 123


def _reason(text: str) -> str:
    encoded = text.encode()
    return text if len(encoded) <= _MAX_REASON else encoded[: _MAX_REASON - 3].decode(errors="ignore") + "..."


async def close_socket(websocket: WebSocket, code: int, reason: str) -> None:
    # The client may be gone already; there is nobody left to tell.
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await websocket.close(code, _reason(reason))


async def _send_events(websocket: WebSocket, sub: Subscription[Relayed]) -> bool:
    """Relay until the stream ends; whether its terminal event was among what was sent (not when the client's
    resume point lay at or past the stream's end)."""
    sent_terminal = False
    while not sub.finished:
        for item in await sub.next_batch():
            await websocket.send_text(item.payload)
            sent_terminal = sent_terminal or item.terminal
    return sent_terminal


async def _receive_commands(websocket: WebSocket, ctx: RelayContext, grant: StreamGrant) -> str | None:
    """Serve client messages until the client leaves (None) or sends something invalid (the reason)."""
    cancelled = False
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return None
        raw = message.get("text")
        if raw is None:
            raw = (message.get("bytes") or b"").decode(errors="replace")
        try:
            command = json_input.loads(raw)
        except ValueError:
            command = None
        if not isinstance(command, dict) or command.get("type") != "cancel":
            return 'unsupported client message: the only one accepted is {"type": "cancel"}'
        if not cancelled:
            # In the background: the stream (and this connection) may end before Kafka has it.
            ctx.canceller.cancel_soon(grant.request_id, grant.tenant)
            cancelled = True


@router.websocket("/v1/streams/{request_id}")
async def stream_websocket(websocket: WebSocket, request_id: str) -> None:
    """Relay one request's stream; see the module docstring for the protocol."""
    ctx = relay_context(websocket)
    # Accept first: a refused handshake shows browsers only "failed", never the close code and reason.
    await websocket.accept()
    params = websocket.query_params
    try:
        grant = authorise(ctx.settings.stream_token_secret, request_id, params.get("token"), params.get("last_id"))
    except (AccessDenied, BadStreamRequest) as exc:
        await close_socket(websocket, CLOSE_POLICY_VIOLATION, str(exc))
        return
    # Subscribed before the probe, so that the probe's round trip also wakes the hub's reader for this stream.
    async with ctx.hub.subscribe(grant.request_id, grant.after_seq, tenant=grant.tenant, wake=False) as sub:
        try:
            status, why, trace = await probe(ctx.hub, ctx.names, grant, want_trace=tracing_enabled(), waking=sub)
        except RedisError as exc:
            log.error("relay.probe_failed request_id=%s error=%r", request_id, exc)
            await close_socket(websocket, CLOSE_TRY_AGAIN_LATER, "stream store unavailable; reconnect later")
            return
        if status is not StreamStatus.OPEN:
            await close_socket(websocket, ENDED_CLOSE_CODES[status], why)
            return

        with ctx.metrics.relaying("websocket", grant, trace):
            sender = asyncio.create_task(_send_events(websocket, sub))
            receiver = asyncio.create_task(_receive_commands(websocket, ctx, grant))
            try:
                await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(sender, receiver)

    if receiver.done() and not receiver.cancelled() and receiver.exception() is None:
        invalid = receiver.result()
        if invalid is not None:
            await close_socket(websocket, CLOSE_POLICY_VIOLATION, invalid)
        return  # otherwise the client left
    if sender.cancelled():
        return
    error = sender.exception()
    if error is None:
        # A resume point past the end closes the same way, but says so: the client got no done, and its last_id
        # was not one of this stream's entries (a client could not tell the two apart).
        why = "stream finished" if sender.result() else "stream finished at or before last_id: nothing after it"
        await close_socket(websocket, CLOSE_NORMAL, why)
    elif isinstance(error, SlowConsumer):
        log.info("relay.slow_consumer_dropped request_id=%s", request_id)
        ctx.metrics.slow_consumers.labels("websocket").inc()
        await close_socket(websocket, CLOSE_TRY_AGAIN_LATER, "client too slow: reconnect with last_id to resume")
    elif isinstance(error, (WebSocketDisconnect, OSError)):
        return
    elif isinstance(error, RedisError):
        log.error("relay.history_failed request_id=%s error=%r", request_id, error)
        await close_socket(websocket, CLOSE_TRY_AGAIN_LATER, "stream store unavailable; reconnect with last_id")
    else:
        log.error("relay.failed request_id=%s", request_id, exc_info=error)
        await close_socket(websocket, 1011, "internal error; reconnect with last_id")


async def no_socket_here(websocket: WebSocket, path: str) -> None:
    """A WebSocket opened where none is served: closed with where the streams are, not the bare 403 a handshake
    that matches no route gets (which says nothing). Registered after every other route."""
    await websocket.accept()
    # The hint first: a close reason is cut at 123 bytes, and a path may be long.
    if path.endswith("/sse"):
        why = f"Server-Sent Events here (GET); the WebSocket is /{path.removesuffix('/sse')}"
    else:
        why = f"no WebSocket here: a stream is /v1/streams/<request_id>, many on /v1/streams (not /{path})"
    await close_socket(websocket, CLOSE_POLICY_VIOLATION, why)
