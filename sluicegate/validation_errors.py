"""Turning pydantic validation errors into a field path and a sentence a client can act on."""

from __future__ import annotations

import re

from pydantic import ValidationError
from pydantic_core import ErrorDetails

# Union branches show up in an error location as the branch's type ("str", "list[int]",
# "function-after[...]"); they are not fields, so the path a client sees leaves them out.
_BRANCH = re.compile(r"[\[\]\-]|^(str|int|float|bool|bytes|list|dict|none|datetime|date|decimal)$")
# Errors that only say "not this branch's type"; when another branch of the same union got further into
# the value (a deeper error path), that error is the useful one.
_TYPE_MISMATCH = frozenset(
    {
        "string_type",
        "int_type",
        "float_type",
        "bool_type",
        "list_type",
        "dict_type",
        "model_type",
        "datetime_type",
        "int_parsing",
        "float_parsing",
        "model_attributes_type",
    }
)


def error_field(error: ErrorDetails) -> str:
    """Dotted path of the field an error is about (``sampling.temperature``, ``messages.0.role``);
    empty for errors about the message as a whole."""
    parts = [str(p) for p in error["loc"] if isinstance(p, int) or not _BRANCH.search(str(p))]
    # A discriminated union puts its tag in the path before the branch's fields: response_format's "json_schema"
    # tag, then its json_schema field. Said twice in a row, a name is the tag and the field: keep one.
    parts = [p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1] or p.isdigit()]
    return ".".join(parts)


def _sentence(error: ErrorDetails) -> str:
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        return "unknown or unsupported parameter"
    if error["type"] == "missing":
        return "field required"
    # "Value error, ..." is pydantic's prefix for ValueErrors raised by validators.
    message = message.removeprefix("Value error, ")
    return message


def _explained(path: str, telling: list[str]) -> bool:
    """Whether a "wrong type" error at ``path`` is a union branch that lost to a more telling error at the
    same field, inside it, or at a sibling item of the same list."""
    parent, _, last = path.rpartition(".")
    for other in telling:
        if other == path or other.startswith(path + "."):
            return True
        if last.isdigit() and other.rpartition(".")[0] == parent:
            return True
    return False


def summarize(exc: ValidationError, *, limit: int = 5, root_field: str = "") -> tuple[str, str]:
    """The first offending field and a message listing up to ``limit`` problems.

    ``root_field`` names errors about the message as a whole (a cross-field check), so callers always
    get a field to report.
    """
    # The branches of a union report one field several times; merge them into one sentence.
    errors = exc.errors(include_url=False)
    telling = [error_field(e) for e in errors if e["type"] not in _TYPE_MISMATCH]
    by_field: dict[str, list[str]] = {}
    for error in errors:
        if error["type"] in _TYPE_MISMATCH and _explained(error_field(error), telling):
            continue
        sentences = by_field.setdefault(error_field(error) or root_field, [])
        sentence = _sentence(error)
        if sentence not in sentences:
            sentences.append(sentence)
    items = [(f"'{field}': " if field else "") + ", or ".join(s) for field, s in by_field.items()]
    text = "; ".join(items[:limit])
    if len(items) > limit:
        text += f"; and {len(items) - limit} more"
    return next(iter(by_field), root_field), text
