"""Following a response's Redis stream: as server-sent events from any sequence number (the events of
:mod:`.events`, replayed from the stream's first entry, the ones numbered up to ``starting_after`` left out),
until the whole response is there (non-streaming create), or as it stands now (``GET``, the sweeper). Whoever
sees a stored response end saves its final object.

A foreground response is cancelled when its client leaves or the stream cannot go on, as a chat completion is;
a background one runs on, and a client comes back for it with ``GET ...?stream=true&starting_after=N``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from redis.exceptions import RedisError

from schemas import StreamEvent
from sluicegate.api.errors import ApiError
from sluicegate.stream_entries import parse_entry

from ..errors import unavailable
from ..service import IngressService
from .events import ResponseEvents
from .objects import ResponseRecord
from .store import ResponseStore, Stored

log = logging.getLogger(__name__)

_PAGE = 1000
_ENDED = frozenset({"finished", "cancelled", "failed"})


def sse_frame(event: dict[str, Any]) -> str:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_event(sequence: int, code: str, message: str) -> dict[str, Any]:
    """The ``error`` event that ends a stream this connection cannot follow further (not part of the
    response's derived events: a client may resume after the last event it had)."""
    return {"type": "error", "sequence_number": sequence, "code": code, "message": message, "param": None}


async def read_stream(service: IngressService, request_id: str, tenant: str) -> list[StreamEvent] | None:
    """The request's stream events as Redis holds them now, in pages; None when there is no stream."""
    key = service.names.stream_key(request_id, tenant)
    events: list[StreamEvent] = []
    start = "-"
    try:
        while True:
            page = await service.redis.xrange(key, min=start, max="+", count=_PAGE)
            for entry_id, fields in page:
                entry = parse_entry(key, entry_id, fields)
                if entry is not None:
                    events.append(entry.event)
            if len(page) < _PAGE:
                break
            last = page[-1][0]
            start = "(" + (last.decode() if isinstance(last, bytes) else last)
        if not events and not await service.redis.exists(key):
            return None
    except (RedisError, OSError) as exc:
        raise unavailable("Redis", exc) from exc
    return events


async def current(service: IngressService, store: ResponseStore, stored: Stored) -> tuple[dict[str, Any], bool]:
    """A stored response as it stands, and whether that is final: its saved final object, else derived from its
    stream now (and saved when the stream has ended). A response whose stream and request record are gone before
    its final object was saved (every ingress down for longer than the stream is kept) is failed, saying so."""
    if stored.final is not None:
        return stored.final, True
    record = stored.record
    builder = ResponseEvents(record)
    events = await read_stream(service, record.request_id, record.tenant)
    if events is None:
        status = await service.record(record.request_id, record.tenant)
        if status is None or status.status in _ENDED:
            builder.status = "failed"
            builder.error = {"code": "server_error", "message": "The response's result is no longer kept."}
    for event in events or []:
        builder.feed(event)
    response = builder.response()
    if builder.finished:
        try:
            await store.finalize(record, response)
        except (RedisError, OSError) as exc:
            raise unavailable("Redis", exc) from exc
    elif stored.cancel_requested:
        cancelled(response)
    return response, builder.finished


def cancelled(response: dict[str, Any]) -> None:
    """Mark a response whose cancel was asked for, before its worker has ended it, as cancelled: its status, and
    the output items still being written, which will never be completed (as the final object will say)."""
    response["status"] = "cancelled"
    for item in response.get("output", []):
        if item.get("status") == "in_progress":
            item["status"] = "incomplete"


async def stream_exists(service: IngressService, request_id: str, tenant: str) -> bool:
    """Whether the request's stream is (still) in Redis."""
    try:
        return bool(await service.redis.exists(service.names.stream_key(request_id, tenant)))
    except (RedisError, OSError) as exc:
        raise unavailable("Redis", exc) from exc


async def sse_events(
    service: IngressService,
    record: ResponseRecord,
    *,
    store: ResponseStore | None,
    starting_after: int | None = None,
    cancel_on_disconnect: bool,
) -> AsyncIterator[str]:
    """The response's events as server-sent events, those numbered above ``starting_after``; saves the final
    object of a stored response (``store``) at its end."""
    after = -1 if starting_after is None else starting_after
    builder = ResponseEvents(record)
    cancel_reason: str | None = "client_disconnected"
    try:
        for event in builder.opening():
            if event["sequence_number"] > after:
                yield sse_frame(event)
        try:
            # One write per read of the stream, as in openai_stream: a token's delta and a stream's closing events
            # (text done, part done, item done, completed) each go out together.
            async for batch in service.event_batches(
                record.request_id, record.tenant, timeout_s=service.settings.request_timeout_s
            ):
                frames = [
                    sse_frame(event)
                    for stream_event in batch
                    for event in builder.feed(stream_event)
                    if event["sequence_number"] > after
                ]
                if frames:
                    yield "".join(frames)
        except TimeoutError as exc:
            cancel_reason = "timeout"
            yield sse_frame(error_event(max(after + 1, builder.sequence), "timeout", str(exc)))
            return
        except ApiError as exc:
            cancel_reason = "relay_failed"
            yield sse_frame(error_event(max(after + 1, builder.sequence), exc.code or "server_error", exc.message))
            return
        cancel_reason = None
        if store is not None and builder.finished:
            with anyio.CancelScope(shield=True):
                try:
                    await store.finalize(record, builder.response())
                except (RedisError, OSError) as exc:  # the sweeper saves it later
                    log.warning("ingress.response_finalize_failed response_id=%s error=%r", record.id, exc)
    finally:
        if cancel_reason is not None and cancel_on_disconnect:
            # Free the worker; shielded, as a disconnect cancels this generator's scope (see openai_stream).
            with anyio.CancelScope(shield=True), anyio.move_on_after(service.settings.kafka_timeout_s + 1):
                try:
                    await service.cancel(record.request_id, record.tenant, reason=cancel_reason)
                except Exception as exc:
                    log.warning("ingress.cancel_failed request_id=%s error=%r", record.request_id, exc)
