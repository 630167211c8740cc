"""JSON from outside (HTTP bodies, WebSocket messages, Kafka records, batch files, model output read as tool
calls), parsed with the standard library: a value nested deeper than the interpreter's recursion limit raises
``RecursionError`` there, which no caller's ``except ValueError`` catches, so one 2 KB body of brackets answered a
500 and one such Kafka record crashed the router on every start. Here it is a ``ValueError`` like any other
malformed input, and every caller's refusal path covers it."""

from __future__ import annotations

import json
from typing import Any


class TooDeepError(ValueError):
    """The JSON text nests arrays or objects too deeply to parse."""


_TOO_DEEP = "JSON nested too deeply (arrays or objects inside one another)"


def _not_json(constant: str) -> Any:
    # Python's parser takes NaN and Infinity, which JSON does not have; taken, "temperature": NaN was refused as
    # "should be less than or equal to 2".
    raise ValueError(f"{constant} is not a JSON value (JSON numbers are finite)")


_DECODER = json.JSONDecoder()


def loads(raw: str | bytes | bytearray) -> Any:
    """``json.loads``, raising :class:`TooDeepError` (a ``ValueError``) instead of ``RecursionError``, and a
    ``ValueError`` for ``NaN`` and ``Infinity``."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise TooDeepError(_TOO_DEEP) from None


def raw_decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """``JSONDecoder.raw_decode``: the value starting at ``pos`` and where it ends, with :func:`loads`' errors."""
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise TooDeepError(_TOO_DEEP) from None
