"""What a valid request-stream entry is, decided in one place: an explicit id ``0-<seq + 1>`` and an
``event`` field holding a stream event whose ``seq`` matches the id.

:func:`parse_entry` is the follower's default decoder (ingress reads its events through it) and the
first step of the result service's wire encoding; entries that break the contract are logged and
skipped, never fatal.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from schemas import STREAM_FIELD, TERMINAL_TYPES, StreamEvent, parse_stream_event, seq_from_entry_id

log = logging.getLogger(__name__)

_FIELD_BYTES = STREAM_FIELD.encode()


class StreamEntry:
    """One valid stream entry: its seq, entry id and event."""

    __slots__ = ("entry_id", "event", "seq", "terminal")

    def __init__(self, seq: int, entry_id: str, event: StreamEvent) -> None:
        self.seq = seq
        self.entry_id = entry_id
        self.event = event
        self.terminal = event.type in TERMINAL_TYPES

    def __repr__(self) -> str:
        return f"StreamEntry(seq={self.seq}, entry_id={self.entry_id!r}, type={self.event.type!r})"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _event_field(fields: Mapping[Any, Any] | Sequence[Any]) -> bytes | str | None:
    # Raw RESP2 replies give a flat [field, value, ...] list; redis-py's parsed replies give a dict.
    if isinstance(fields, Mapping):
        value = fields.get(_FIELD_BYTES)
        return value if value is not None else fields.get(STREAM_FIELD)
    for i in range(0, len(fields) - 1, 2):
        if _text(fields[i]) == STREAM_FIELD:
            return fields[i + 1]
    return None


def parse_entry(
    stream_key: str, entry_id: bytes | str, fields: Mapping[Any, Any] | Sequence[Any]
) -> StreamEntry | None:
    """The event of one stream entry, or None (logged) when the entry breaks the stream contract.

    A malformed entry is a producer bug; skipping it keeps the rest of the stream flowing.
    """
    entry = _text(entry_id)
    try:
        seq = seq_from_entry_id(entry)
    except ValueError:
        log.warning("stream.bad_entry_id stream=%s entry_id=%s", stream_key, entry)
        return None
    raw = _event_field(fields)
    if raw is None:
        log.warning("stream.entry_without_event stream=%s entry_id=%s", stream_key, entry)
        return None
    try:
        event = parse_stream_event(raw)
    except ValidationError as exc:
        log.warning(
            "stream.invalid_event stream=%s entry_id=%s error=%s", stream_key, entry, exc.errors(include_url=False)[:3]
        )
        return None
    if event.seq != seq:
        log.warning("stream.seq_mismatch stream=%s entry_id=%s event_seq=%d", stream_key, entry, event.seq)
        return None
    return StreamEntry(seq, entry, event)
