"""A request's deadline as clients give it: the ``deadline`` body field or the ``X-Request-Deadline`` header.

Either form takes a number of seconds from now (``30``, ``2.5``; also as a string, since a header is one) or an
absolute RFC 3339 time with a zone (``2026-11-26T16:00:00Z``, ``...+01:00``). Anything else is refused, naming
the field: a time without a zone, a date alone, ``true``, less than a microsecond, more than a year from now.
The body's field wins over the header when both are given. The deadline is the time after which the request is
not started: within a tier, requests with one go earliest-deadline-first, and admission refuses one the backlog
cannot meet (``deadline_unmeetable``).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema

#: Longest relative deadline (seconds from now) a request may give: a year, far past any queue wait.
MAX_DEADLINE_S = 365 * 86400
#: Shortest relative deadline: a microsecond, the resolution of a time; anything shorter is now, already passed.
MIN_DEADLINE_S = 1e-6
#: The header that carries a deadline for any endpoint (same forms as the body field).
DEADLINE_HEADER = "X-Request-Deadline"

_FORMS = "seconds from now (a number) or an RFC 3339 time with a zone, e.g. 2026-11-26T16:00:00Z"


def parse_deadline(value: Any) -> datetime | float:
    """The deadline ``value`` stands for: relative seconds as a float, or an aware datetime; ``ValueError``
    saying which forms are accepted for anything else."""
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"a deadline time needs a zone: {_FORMS}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"a deadline is {_FORMS}")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            return _absolute(text)
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or not MIN_DEADLINE_S <= seconds <= MAX_DEADLINE_S:
        raise ValueError(f"a relative deadline is at least {MIN_DEADLINE_S:g} and at most {MAX_DEADLINE_S} seconds")
    return seconds


def _absolute(text: str) -> datetime:
    # RFC 3339 wants a full time: "2026-11-26" alone parses as a date, which is not a deadline.
    try:
        when = datetime.fromisoformat(text.upper()) if "T" in text.upper() else None  # RFC 3339 allows "t", "z"
    except ValueError:
        when = None
    if when is None:
        raise ValueError(f"a deadline is {_FORMS}; got {text[:64]!r}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"a deadline time needs a zone: {_FORMS}")
    return when


def absolute_deadline(deadline: datetime | float | None, now: datetime) -> datetime | None:
    """A parsed deadline as an aware datetime (relative seconds counted from ``now``)."""
    if deadline is None or isinstance(deadline, datetime):
        return deadline
    return now + timedelta(seconds=deadline)


DeadlineField = Annotated[
    datetime | float,
    PlainValidator(parse_deadline),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": MIN_DEADLINE_S, "maximum": MAX_DEADLINE_S},
                {"type": "string", "format": "date-time"},
            ],
            "description": "Deadline: seconds from now, or an RFC 3339 time with a zone (also the "
            "X-Request-Deadline header). A time that has already passed is a 400 (invalid_value). Earliest "
            "deadlines start first within a tier; one the backlog cannot meet is a 429 deadline_unmeetable.",
        }
    ),
]
"""The ``deadline`` field of a request body, as :func:`parse_deadline` reads it."""
