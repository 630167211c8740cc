"""The one check of an incoming Kafka request record, and the one dead-letter builder.

Both the router's stream processor (``llm.inbound``) and the GPU worker (``llm.<model>.<tier>``) turn a record
into an :class:`~schemas.InferenceRequest` or a :class:`Rejection` here, and build the ``llm.dlq`` record for a
rejection here, so the reasons a client or an operator sees are the same wherever a record was refused.

Records are duck-typed (``topic``, ``partition``, ``offset``, ``value``, ``headers``): aiokafka's
``ConsumerRecord`` fits, and nothing here needs Kafka itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from pydantic import ValidationError

from schemas import DeadLetter, InferenceRequest
from schemas.names import HEADER_REASON, HEADER_REQUEST_ID, HEADER_TRACEPARENT, HEADER_TRACESTATE
from sluicegate import json_input
from sluicegate.validation_errors import summarize

#: Kafka record headers as aiokafka reads and writes them.
Headers = list[tuple[str, bytes]]

#: A dead letter's ``detail`` is cut here: it may be an exception's repr, and an oversized letter would be
#: refused by Kafka, while its sender retries until Kafka takes it.
DETAIL_LIMIT = 4000

#: The most a dead letter's value may take. Its payload is the refused record, JSON-escaped, which can be several
#: times the record's size (a quote or a control character takes 2-6 bytes): a record the broker took whole
#: could otherwise make a letter no producer may send, and the sender would retry it forever. Under Kafka's
#: default ``message.max.bytes`` (1 MB), so any broker's DLQ takes it.
LETTER_LIMIT = 1_000_000


class SourceRecord(Protocol):
    """What a dead letter needs of the refused record (aiokafka's ``ConsumerRecord`` has it)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Iterable[tuple[str, bytes | None]] | None: ...


@dataclass(frozen=True)
class Rejection:
    """Why a record is not served: ``reason`` is machine-readable and goes into the ``reason`` header."""

    reason: str
    detail: str
    request_id: str | None = None
    # Whose record it is, where that is known apart from the record (the router's per-tenant inbound topics):
    # its dead letter and stream then are the tenant's.
    tenant: str | None = None


def reason_kind(reason: str) -> str:
    """A reason without the detail after its ``:`` (``schema_violation:sampling.max_tokens`` is
    ``schema_violation``): the form for a metric label, since a field name comes from whoever wrote the record and
    would grow a time series per name, and for an ``error`` event's code."""
    return reason.partition(":")[0]


def header(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> str | None:
    """The first value of header ``name`` (decoded), or None."""
    for key, value in headers or ():
        if key == name and value is not None:
            return value.decode("utf-8", errors="replace")
    return None


def request_id_of(value: bytes | None, headers: Iterable[tuple[str, bytes | None]] | None = None) -> str | None:
    """A record's request id for its dead letter: the JSON body's, which names the request everywhere else (the
    stream, the result, ``dlq replay --request-id``), else the ``request_id`` header's, for a body that cannot
    be read."""
    try:
        body = json_input.loads(value or b"")
    except ValueError:
        body = None
    return _request_id_in(body, headers)


def _request_id_in(body: object, headers: Iterable[tuple[str, bytes | None]] | None) -> str | None:
    """:func:`request_id_of` for a body already parsed."""
    value_id = body.get("request_id") if isinstance(body, dict) else None
    if isinstance(value_id, str) and value_id:
        return value_id
    return header(headers, HEADER_REQUEST_ID) or None


_UTF8_BOM = b"\xef\xbb\xbf"


def record_json(value: bytes) -> bytes:
    """A record's value as its JSON is parsed: without a leading UTF-8 byte-order mark, which RFC 8259 lets a
    parser ignore and some Java and .NET writers put first (the router, and a replay of its dead letter)."""
    return value.removeprefix(_UTF8_BOM)


def validate_record(
    value: bytes | None,
    headers: Iterable[tuple[str, bytes | None]] | None = None,
    *,
    now: datetime | None = None,
    check_deadline: bool = True,
) -> InferenceRequest | Rejection:
    """Parse one request record's value: the request, or why it goes to the DLQ.

    Reasons: ``empty_message``, ``invalid_json``, ``not_an_object``, ``schema_violation:<field>`` (the first
    offending field, e.g. ``schema_violation:priority`` for an unknown tier; errors about the message as a
    whole are reported on ``prompt``), ``unreadable_record`` (reading it failed otherwise) and, with
    ``check_deadline``, ``deadline_exceeded``. The rejection's
    request id is :func:`request_id_of`'s.

    The worker passes ``check_deadline=False``: a deadline is about *starting*, and only the stream can tell
    whether a re-delivered request already started.
    """
    if not value:
        return Rejection("empty_message", "the record has no value", header(headers, HEADER_REQUEST_ID))
    value = record_json(value)
    try:
        request = InferenceRequest.model_validate_json(value)
    except ValidationError as exc:
        # Parsed a second time only for a refused record: a valid one (the common case) is parsed once.
        try:
            return _classify(value, headers, exc)
        except Exception as err:
            # A record the consumer cannot read must still reach the DLQ: raised, it would stop the consumer on it
            # at every start (it is never committed), a poison pill for its whole partition.
            detail = f"the record could not be read: {err!r}"
            return Rejection("unreadable_record", detail, header(headers, HEADER_REQUEST_ID))
    if check_deadline and request.expired(now):
        assert request.deadline is not None
        return Rejection("deadline_exceeded", f"deadline {request.deadline.isoformat()} passed", request.request_id)
    return request


def _classify(value: bytes, headers: Iterable[tuple[str, bytes | None]] | None, exc: ValidationError) -> Rejection:
    """Why a value that is not an ``InferenceRequest`` is not one."""
    try:
        # Decoded here, not by json.loads: it would read UTF-16 and UTF-32 too, which the record's parser does not,
        # and the refusal would then blame a field.
        body = json_input.loads(value.decode("utf-8"))
    except UnicodeDecodeError as err:
        detail = f"not UTF-8 text ({err.reason} at byte {err.start}): a record's JSON must be UTF-8"
        # Still named by its body's id where json.loads can read one (UTF-16 or -32): its stream hears why.
        return Rejection("invalid_json", detail, request_id_of(value, headers))
    except ValueError as err:
        return Rejection("invalid_json", f"not valid JSON: {err}", header(headers, HEADER_REQUEST_ID))
    if not isinstance(body, dict):
        detail = f"expected a JSON object, got {type(body).__name__}"
        return Rejection("not_an_object", detail, header(headers, HEADER_REQUEST_ID))
    field, detail = summarize(exc, root_field="prompt")
    return Rejection(f"schema_violation:{field}", detail, _request_id_in(body, headers))


def dead_letter(rejection: Rejection, record: SourceRecord) -> tuple[bytes, Headers]:
    """The ``llm.dlq`` value and headers for a refused record: reason, request id and trace context kept."""
    letter = DeadLetter(
        reason=rejection.reason,
        detail=rejection.detail[:DETAIL_LIMIT],
        source_topic=record.topic,
        source_partition=record.partition,
        source_offset=record.offset,
        payload=(record.value or b"").decode("utf-8", errors="replace"),
        request_id=rejection.request_id,
    )
    headers: Headers = [(HEADER_REASON, rejection.reason.encode())]
    if rejection.request_id:
        headers.append((HEADER_REQUEST_ID, rejection.request_id.encode()))
    for name in (HEADER_TRACEPARENT, HEADER_TRACESTATE):
        value = header(record.headers, name)
        if value:
            headers.append((name, value.encode()))
    return _fitted(letter), headers


def _fitted(letter: DeadLetter) -> bytes:
    """The letter's JSON, its payload cut (and marked so) until it fits in :data:`LETTER_LIMIT` bytes."""
    value = letter.model_dump_json().encode()
    while len(value) > LETTER_LIMIT:
        # Each pass keeps the share of the payload that would fit if its escaping were even; escaping is
        # uneven, so another pass may cut again (at least a tenth each time: a few passes at most).
        keep = min(int(len(letter.payload) * LETTER_LIMIT / len(value)), len(letter.payload) * 9 // 10)
        letter = letter.model_copy(update={"payload": letter.payload[:keep], "payload_truncated": True})
        value = letter.model_dump_json().encode()
    return value
