"""What the relay sends: one Redis stream entry turned into the client-facing JSON event, once.

The payload is encoded a single time per entry and shared by every subscriber of the stream, so the
fan-out never re-serialises. Entry ids follow :func:`schemas.stream_entry_id` (``0-<seq + 1>``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from schemas import STREAM_FIELD, TERMINAL_TYPES, parse_stream_event, seq_from_entry_id

log = logging.getLogger(__name__)

_FIELD_BYTES = STREAM_FIELD.encode()
#: The cursor before the first entry: "nothing seen yet".
START_SEQ = -1


class BadLastId(ValueError):
    """A ``last_id`` / ``Last-Event-ID`` that is not a Sluicegate stream entry id."""


class Relayed:
    """One event ready to send: its seq and entry id (for dedupe and resume) and the JSON text."""

    __slots__ = ("entry_id", "payload", "seq", "terminal")

    def __init__(self, seq: int, entry_id: str, payload: str, terminal: bool) -> None:
        self.seq = seq
        self.entry_id = entry_id
        self.payload = payload
        self.terminal = terminal

    def __repr__(self) -> str:
        return f"Relayed(seq={self.seq}, entry_id={self.entry_id!r}, terminal={self.terminal})"


def parse_last_id(value: str | None) -> int:
    """The seq a resuming client has already seen (``START_SEQ`` when it has seen nothing).

    Accepts an entry id the relay sent (``0-<n>``) or ``0-0`` for "from the beginning".
    """
    if value is None or value == "":
        return START_SEQ
    if value == "0-0":
        return START_SEQ
    try:
        return seq_from_entry_id(value)
    except ValueError:
        raise BadLastId(
            f"last_id {value[:40]!r} is not a stream entry id: pass the 'id' of the last event received "
            "(like '0-42'), or '0-0' to start from the beginning"
        ) from None


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _event_field(fields: Mapping[Any, Any] | Sequence[Any]) -> bytes | str | None:
    # Raw RESP2 replies give a flat [field, value, ...] list; redis-py's parsed replies give a dict.
    if isinstance(fields, Mapping):
        value = fields.get(_FIELD_BYTES)
        return value if value is not None else fields.get(STREAM_FIELD)
    for i in range(0, len(fields) - 1, 2):
        if _decode(fields[i]) == STREAM_FIELD:
            return fields[i + 1]
    return None


def to_relayed(stream_key: str, entry_id: bytes | str, fields: Mapping[Any, Any] | Sequence[Any]) -> Relayed | None:
    """The client event for one stream entry, or None (logged) when the entry breaks the contract.

    A malformed entry is a producer bug; skipping it keeps the rest of the stream flowing.
    """
    entry = _decode(entry_id)
    try:
        seq = seq_from_entry_id(entry)
    except ValueError:
        log.warning("relay.bad_entry_id stream=%s entry_id=%s", stream_key, entry)
        return None
    raw = _event_field(fields)
    if raw is None:
        log.warning("relay.entry_without_event stream=%s entry_id=%s", stream_key, entry)
        return None
    try:
        event = parse_stream_event(raw)
    except ValidationError as exc:
        log.warning(
            "relay.invalid_event stream=%s entry_id=%s error=%s",
            stream_key,
            entry,
            exc.errors(include_url=False)[:3],
        )
        return None
    if event.seq != seq:
        log.warning("relay.seq_mismatch stream=%s entry_id=%s event_seq=%d", stream_key, entry, event.seq)
        return None
    body = event.model_dump(mode="json")
    # Clients key on "type" first; "id" is what they pass back as last_id on reconnect.
    message = {"type": body.pop("type"), "seq": body.pop("seq"), **body, "id": entry}
    payload = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    return Relayed(seq, entry, payload, event.type in TERMINAL_TYPES)
