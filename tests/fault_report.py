"""The fault tests' ``FAULT-REPORT`` line, with losses and duplicates counted from what the clients received.

A report never states a figure it did not measure: :func:`fault_report` takes the counted :class:`Delivery` (or
one per client) and prints its numbers, so a line says ``"losses": 0`` only when the count was 0.

* :func:`count_events`: clients that see ``seq`` numbers (a WebSocket, a live ``XREAD`` reader, a reader of the
  stream after the fact). A loss is a ``seq`` of the complete stream (0 up to its terminal event) that the client
  never received; a duplicate is an event received again under a ``seq`` it already had.
* :func:`count_text`: clients that see only text (OpenAI SSE chunks). Counted in characters against the
  uninterrupted run's text: missing characters are losses, extra ones duplicates.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Delivery:
    """What a client missed and what it received twice (summed over its requests)."""

    losses: int
    duplicates: int

    def __add__(self, other: Delivery) -> Delivery:
        return Delivery(self.losses + other.losses, self.duplicates + other.duplicates)


def count_events(received: Mapping[str, Sequence[int]], final_seq: Mapping[str, int]) -> Delivery:
    """Losses and duplicates from the seqs each request's client received, in arrival order.

    ``final_seq`` is each request's terminal (``done``/``error``) seq on the stream: the complete stream is
    ``0..final_seq``. A request the client received nothing of counts every one of those as lost.
    """
    total = Delivery(0, 0)
    for request_id, final in final_seq.items():
        seqs = received.get(request_id, ())
        distinct = set(seqs)
        missing = sum(1 for seq in range(final + 1) if seq not in distinct)
        total += Delivery(losses=missing, duplicates=len(seqs) - len(distinct))
    return total


def count_text(received: str, expected: str) -> Delivery:
    """Characters of ``expected`` the client's text lacks (losses) and characters it has beyond it (duplicates)."""
    losses = duplicates = 0
    matcher = difflib.SequenceMatcher(None, expected, received, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("delete", "replace"):
            losses += i2 - i1
        if tag in ("insert", "replace"):
            duplicates += j2 - j1
    return Delivery(losses, duplicates)


def fault_report(name: str, delivery: Delivery | Mapping[str, Delivery], **figures: object) -> None:
    """Prints ``FAULT-REPORT {...}`` (run pytest with ``-s``): ``figures`` plus the counted losses and duplicates
    (per client when ``delivery`` is a mapping of client name to :class:`Delivery`)."""
    if isinstance(delivery, Delivery):
        counted: dict[str, object] = {"losses": delivery.losses, "duplicates": delivery.duplicates}
    else:
        counted = {
            "losses": {client: d.losses for client, d in delivery.items()},
            "duplicates": {client: d.duplicates for client, d in delivery.items()},
        }
    print(f"\nFAULT-REPORT {json.dumps({'test': name, **figures, **counted})}")
