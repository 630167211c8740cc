"""What the relay sends: one Redis stream entry turned into the client-facing JSON event, once.

The payload is encoded a single time per entry and shared by every subscriber of the stream, so the
fan-out never re-serialises. Entry ids follow :func:`schemas.stream_entry_id` (``0-<seq + 1>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from schemas import seq_from_entry_id
from sluicegate.stream_entries import parse_entry
from sluicegate.stream_subscription import START_SEQ


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


def to_relayed(stream_key: str, entry_id: bytes | str, fields: Mapping[Any, Any] | Sequence[Any]) -> Relayed | None:
    """The client event for one stream entry, or None when the entry breaks the stream contract
    (logged by :func:`sluicegate.stream_entries.parse_entry`)."""
    entry = parse_entry(stream_key, entry_id, fields)
    if entry is None:
        return None
    body = entry.event.model_dump(mode="json")
    # Clients key on "type" first; "id" is what they pass back as last_id on reconnect.
    message = {"type": body.pop("type"), "seq": body.pop("seq"), **body, "id": entry.entry_id}
    payload = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    return Relayed(entry.seq, entry.entry_id, payload, entry.terminal)
