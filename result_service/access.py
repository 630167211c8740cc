"""Who may read a stream, from where, and whether there is anything left to read.

Shared by the WebSocket and SSE endpoints: both check the request id, the stream token (an HMAC
bound to request id, tenant and the token's expiry) and the resume point, then probe Redis once so that a client
resuming after the end, or asking for an expired stream, gets an answer instead of waiting forever.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from schemas import Names, RequestRecord, TraceContext
from schemas.common import RequestId
from sluicegate.stream_entries import parse_entry
from sluicegate.stream_subscription import START_SEQ, Subscription
from sluicegate.stream_tokens import InvalidStreamToken, verify_stream_token

from .hub import StreamHub
from .wire import BadLastId, Relayed, parse_last_id

log = logging.getLogger(__name__)

_request_id: TypeAdapter[str] = TypeAdapter(RequestId)
_ENDED_STATUSES = frozenset({"finished", "cancelled", "failed"})


class AccessDenied(Exception):
    """No valid stream token for this request, or an expired one (WebSocket 1008, HTTP 401)."""


class BadStreamRequest(ValueError):
    """A malformed request id or resume point (WebSocket 1008, HTTP 400)."""


@dataclass(frozen=True)
class StreamGrant:
    """A checked request to read one stream."""

    request_id: str
    tenant: str
    #: Seq of the last event the client already has (-1: start from the beginning).
    after_seq: int


def authorise(
    secret: str, request_id: str, token: str | None, *last_ids: str | None, now: float | None = None
) -> StreamGrant:
    """Check the request id, the token (and its expiry, against ``now``: the clock by default) and every resume
    point given; the latest resume point wins.

    Raises :class:`BadStreamRequest` or :class:`AccessDenied` with a message fit for the client.
    """
    try:
        _request_id.validate_python(request_id)
    except ValidationError:
        raise BadStreamRequest("request id must be 1-128 characters of letters, digits and . _ : -") from None
    if not token:
        raise AccessDenied("missing stream token: pass the stream_token from the submit response as ?token=")
    try:
        tenant = verify_stream_token(secret, request_id, token, now=now)
    except InvalidStreamToken as exc:  # expired ones included: the message says which
        raise AccessDenied(str(exc)) from None
    try:
        after = max((parse_last_id(last_id) for last_id in last_ids), default=START_SEQ)
    except BadLastId as exc:
        raise BadStreamRequest(str(exc)) from None
    return StreamGrant(request_id, tenant, after)


class StreamStatus(enum.Enum):
    #: Events may still come (or the stream does not exist yet because the request is queued).
    OPEN = "open"
    #: The client already has the terminal event.
    FINISHED = "finished"
    #: The request ended and its stream is gone (its TTL passed).
    EXPIRED = "expired"


async def probe(
    hub: StreamHub,
    names: Names,
    grant: StreamGrant,
    *,
    want_trace: bool = False,
    waking: Subscription[Relayed] | None = None,
) -> tuple[StreamStatus, str, TraceContext | None]:
    """Where the stream stands relative to the client's resume point, with a human-readable reason, and (with
    ``want_trace``, while tracing is on) the request's trace context from its status record.

    ``waking``: the client's subscription, opened with ``wake=False`` before the probe; the probe's round trip
    then also wakes the hub's reader for it (:meth:`StreamFollower.execute_waking`)."""
    key = names.stream_key(grant.request_id, grant.tenant)
    async with hub.bounded() as redis:
        pipe = redis.pipeline(transaction=False)
        pipe.xrevrange(key, "+", "-", count=1)
        pipe.get(names.request_key(grant.request_id, grant.tenant))
        if waking is None:
            last_entries, raw_record = await pipe.execute()
        else:
            last_entries, raw_record = await hub.execute_waking(waking, pipe)
    if last_entries:
        entry_id, fields = last_entries[0]
        last = parse_entry(key, entry_id, fields)
        if last is not None and last.terminal and last.seq <= grant.after_seq:
            return StreamStatus.FINISHED, "stream already finished", None
        # The record is parsed only for its trace here, so only while someone wants it.
        return StreamStatus.OPEN, "", _record(grant, raw_record).trace if want_trace and raw_record else None
    if raw_record is None:
        return StreamStatus.OPEN, "", None
    record = _record(grant, raw_record)
    if record.status in _ENDED_STATUSES:
        return StreamStatus.EXPIRED, f"request {record.status}; its stream has expired", None
    return StreamStatus.OPEN, "", record.trace


def _record(grant: StreamGrant, raw: bytes) -> RequestRecord | _NoRecord:
    try:
        return RequestRecord.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("relay.bad_request_record request_id=%s error=%s", grant.request_id, exc.errors()[:1])
        return _NoRecord()


class _NoRecord:
    """An unreadable status record: says nothing about the stream."""

    status = "unknown"
    trace = None
