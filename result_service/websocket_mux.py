"""``/v1/streams`` over WebSocket: many requests' streams on one socket (:mod:`schemas.relay`).

A chat page or a gateway that keeps one socket open pays the handshake, the connection's tasks and its close once
instead of once per request: on the 2-core box about 0.7 ms of the relay's CPU and 1 ms of the client's per
request (``docs/benchmarks.md``). Each subscription keeps the single-stream socket's guarantees: the same
token check, probe and resume point, every event once and in order (each carries its ``request_id``), and a
``closed`` notice with the close code that socket would have used when a subscription ends without ``done`` or
``error``. A client message that cannot be served gets an ``invalid`` notice; the socket and its other streams
go on. Two things end the whole socket, as they end the single one: the client leaving (its requests go on; it
subscribes again with ``last_id``) and a client too slow to read what its streams produce (1013).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.websockets import WebSocketDisconnect

from schemas.relay import CLIENT_MESSAGE, Cancel, Invalid, StreamClosed, Subscribe, Unsubscribe
from sluicegate.stream_subscription import SlowConsumer
from sluicegate.task_stop import cancel_and_wait
from sluicegate.telemetry import tracing_enabled
from sluicegate.validation_errors import summarize

from .access import AccessDenied, BadStreamRequest, StreamGrant, StreamStatus, authorise, probe
from .context import RelayContext, relay_context
from .websocket import (
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    ENDED_CLOSE_CODES,
    close_socket,
)

log = logging.getLogger(__name__)

router = APIRouter()

TRANSPORT = "websocket-mux"
_EXPECTED = 'send {"type": "subscribe", "request_id", "token", "last_id"?}, "unsubscribe" or "cancel" with "request_id"'


class _Session:
    """One multiplexed socket: its subscriptions (a task each), the commands it receives, one sender at a time."""

    def __init__(self, websocket: WebSocket, ctx: RelayContext) -> None:
        self.websocket = websocket
        self.ctx = ctx
        self.subscriptions: dict[str, tuple[StreamGrant, asyncio.Task[None]]] = {}
        self._sending = asyncio.Lock()
        # Set when a subscription finds the client too slow: the whole socket is closed with 1013.
        self.too_slow = asyncio.Event()

    async def send(self, payloads: list[str]) -> None:
        # One subscription's batch goes out whole, so frames of different streams never interleave mid-batch and
        # each frame is one write.
        async with self._sending:
            for payload in payloads:
                await self.websocket.send_text(payload)

    async def notice(self, message: StreamClosed | Invalid) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await self.send([message.model_dump_json()])

    async def receive_commands(self) -> None:
        """Serve client messages until the client leaves."""
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            try:
                command = CLIENT_MESSAGE.validate_json(raw)
            except ValidationError as exc:
                if any(error["type"] == "json_invalid" for error in exc.errors(include_url=False)):
                    # Not JSON at all: no field is to blame (the summary would name ``type``).
                    await self.notice(Invalid(reason=f"not a JSON message ({_EXPECTED})"))
                    continue
                _, problems = summarize(exc, root_field="type")
                await self.notice(Invalid(reason=f"unsupported message ({_EXPECTED}): {problems}"))
                continue
            if isinstance(command, Subscribe):
                await self.subscribe(command)
            elif isinstance(command, Unsubscribe):
                await self.unsubscribe(command.request_id)
            else:
                await self.cancel(command)

    async def subscribe(self, command: Subscribe) -> None:
        rid = command.request_id
        current = self.subscriptions.get(rid)
        if current is not None and not current[1].done():
            await self.notice(Invalid(request_id=rid, reason="already subscribed to this request on this socket"))
            return
        limit = self.ctx.hub.config.mux_max_streams
        if len(self.subscriptions) >= limit:
            reason = f"this socket follows {limit} streams already (the limit): open another socket"
            await self.notice(StreamClosed(request_id=rid, code=CLOSE_POLICY_VIOLATION, reason=reason))
            return
        try:
            grant = authorise(self.ctx.settings.stream_token_secret, rid, command.token, command.last_id)
        except (AccessDenied, BadStreamRequest) as exc:
            await self.notice(StreamClosed(request_id=rid, code=CLOSE_POLICY_VIOLATION, reason=str(exc)))
            return
        task = asyncio.create_task(self._relay(grant), name=f"mux-relay-{rid}")
        self.subscriptions[rid] = (grant, task)
        task.add_done_callback(lambda _: self._forget(rid, task))

    def _forget(self, rid: str, task: asyncio.Task[None]) -> None:
        current = self.subscriptions.get(rid)
        if current is not None and current[1] is task:
            del self.subscriptions[rid]

    async def unsubscribe(self, rid: str) -> None:
        current = self.subscriptions.pop(rid, None)
        if current is None:
            await self.notice(Invalid(request_id=rid, reason="not subscribed to this request on this socket"))
            return
        await cancel_and_wait(current[1])
        await self.notice(StreamClosed(request_id=rid, code=CLOSE_NORMAL, reason="unsubscribed"))

    async def cancel(self, command: Cancel) -> None:
        current = self.subscriptions.get(command.request_id)
        if current is None:
            # The stream token of a subscription is what proves the right to cancel; none, no cancel.
            reason = "not subscribed to this request on this socket: subscribe with its token, then cancel"
            await self.notice(Invalid(request_id=command.request_id, reason=reason))
            return
        grant = current[0]
        # In the background: the stream may end before Kafka has the cancel.
        self.ctx.canceller.cancel_soon(grant.request_id, grant.tenant)

    async def _relay(self, grant: StreamGrant) -> None:
        """Follow one stream to its end on this socket (one subscription's task)."""
        ctx, rid = self.ctx, grant.request_id
        try:
            # Subscribed before the probe, so that the probe's round trip also wakes the hub's reader.
            async with ctx.hub.subscribe(rid, grant.after_seq, tenant=grant.tenant, wake=False) as sub:
                status, why, trace = await probe(ctx.hub, ctx.names, grant, want_trace=tracing_enabled(), waking=sub)
                if status is not StreamStatus.OPEN:
                    await self.notice(StreamClosed(request_id=rid, code=ENDED_CLOSE_CODES[status], reason=why))
                    return
                with ctx.metrics.relaying(TRANSPORT, grant, trace):
                    while not sub.finished:
                        await self.send([item.payload for item in await sub.next_batch()])
                if sub.resumed_past_end:  # no done came: say why the subscription ends, as the probe would have
                    code = ENDED_CLOSE_CODES[StreamStatus.FINISHED]
                    await self.notice(StreamClosed(request_id=rid, code=code, reason="stream already finished"))
        except SlowConsumer:
            log.info("relay.slow_consumer_dropped request_id=%s transport=%s", rid, TRANSPORT)
            ctx.metrics.slow_consumers.labels(TRANSPORT).inc()
            self.too_slow.set()
        except RedisError as exc:
            log.error("relay.stream_store_failed request_id=%s error=%r", rid, exc)
            reason = "stream store unavailable; subscribe again with last_id"
            await self.notice(StreamClosed(request_id=rid, code=CLOSE_TRY_AGAIN_LATER, reason=reason))
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the client left; the session ends with its receive loop

    async def close(self) -> None:
        await cancel_and_wait(*(task for _, task in self.subscriptions.values()))
        self.subscriptions.clear()


@router.websocket("/v1/streams")
async def multiplexed_streams(websocket: WebSocket) -> None:
    """Relay any number of requests' streams on one socket; see the module docstring and :mod:`schemas.relay`."""
    ctx = relay_context(websocket)
    session = _Session(websocket, ctx)
    await websocket.accept()
    receiver = asyncio.create_task(session.receive_commands())
    too_slow = asyncio.create_task(session.too_slow.wait())
    ctx.metrics.mux_sockets.inc()
    try:
        await asyncio.wait({receiver, too_slow}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ctx.metrics.mux_sockets.dec()
        await cancel_and_wait(receiver, too_slow)
        await session.close()
    if session.too_slow.is_set():
        reason = "client too slow: reconnect and subscribe again with each stream's last_id"
        await close_socket(websocket, CLOSE_TRY_AGAIN_LATER, reason)
        return
    error = None if receiver.cancelled() else receiver.exception()
    if error is not None and not isinstance(error, (WebSocketDisconnect, OSError)):
        log.error("relay.mux_failed", exc_info=error)
        await close_socket(websocket, 1011, "internal error; reconnect and subscribe again with last_id")
