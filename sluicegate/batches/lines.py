"""Reading a batch input file: each line checked as a :class:`schemas.BatchInputLine` (JSON object, unique
string ``custom_id``, ``method`` POST, a batch endpoint as ``url``, a ``body`` object), with errors that name
the line. Used at upload (the whole file, before it is stored) and when a batch is validated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pydantic import ValidationError

from schemas import BatchInputLine
from sluicegate import json_input
from sluicegate.validation_errors import summarize


class InputFileError(ValueError):
    """A batch input file that cannot be used: ``status`` (400 or 413), a message naming the line, and a code."""

    def __init__(self, message: str, *, code: str = "invalid_file", line: int | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.code = code
        self.line = line
        self.status = status


@dataclass(frozen=True)
class FileSummary:
    """What a checked input file holds: its line count and its one endpoint."""

    lines: int
    endpoint: str | None


def parse_line(raw: bytes, number: int) -> BatchInputLine:
    """One input line, or :class:`InputFileError` naming line ``number`` (1-based) and what is wrong."""
    try:
        data = json_input.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputFileError(f"Line {number} is not valid JSON: {exc}", code="invalid_json_line", line=number) from None
    if not isinstance(data, dict):
        raise InputFileError(f"Line {number} is not a JSON object.", code="invalid_json_line", line=number)
    try:
        return BatchInputLine.model_validate(data)
    except ValidationError as exc:
        _field, message = summarize(exc)
        raise InputFileError(f"Line {number}: {message}", code="invalid_request_line", line=number) from None


def numbered_lines(raw_lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, content) of each non-blank line; numbers count every physical line, as an editor shows."""
    for number, raw in enumerate(raw_lines, start=1):
        stripped = raw.strip()
        if stripped:
            yield number, stripped


def check_input_file(raw_lines: Iterable[bytes], *, max_lines: int) -> FileSummary:
    """Check a whole input file line by line; the first problem raises :class:`InputFileError`.

    Beyond each line's shape: ``custom_id`` unique, one endpoint for the whole file (a batch targets one), at most
    ``max_lines`` lines, and at least one.
    """
    seen: dict[str, int] = {}
    endpoint: str | None = None
    count = 0
    for number, raw in numbered_lines(raw_lines):
        count += 1
        if count > max_lines:
            raise InputFileError(
                f"The file has more than {max_lines} lines (line {number} is over the limit); split it into "
                "several batches.",
                code="too_many_lines",
                line=number,
            )
        line = parse_line(raw, number)
        first = seen.get(line.custom_id)
        if first is not None:
            raise InputFileError(
                f"Line {number}: custom_id {line.custom_id!r} is already used on line {first}; each must be unique.",
                code="duplicate_custom_id",
                line=number,
            )
        seen[line.custom_id] = number
        if endpoint is None:
            endpoint = line.url
        elif line.url != endpoint:
            raise InputFileError(
                f"Line {number}: url {line.url!r} differs from the file's first line ({endpoint!r}); a batch file "
                "targets one endpoint.",
                code="mixed_endpoints",
                line=number,
            )
    if count == 0:
        raise InputFileError("The file holds no requests.", code="empty_file")
    return FileSummary(count, endpoint)
