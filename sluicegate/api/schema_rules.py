"""Rules between a body's fields (exactly one of two, one needs another, two exclude each other), written as
JSON Schema for the OpenAPI document.

Each body's validators enforce these rules; the document states them too, so that what a client generated from
the document sends is what the validators accept. A rule is a JSON Schema that constrains the whole body object
alongside its ``properties``; :func:`rules` puts a model's rules under ``allOf`` (``json_schema_extra``).
A field given as null counts as left out, as the validators count it.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

#: Any JSON value but null.
NOT_NULL: Schema = {"type": ["string", "number", "integer", "boolean", "array", "object"]}


def given(name: str, schema: Schema | None = None) -> Schema:
    """``name`` is there and not null (and matches ``schema`` when one is given)."""
    return {"properties": {name: schema or NOT_NULL}, "required": [name]}


def left_out(*names: str) -> Schema:
    """None of ``names`` is there, or each is null."""
    return {"properties": {name: {"type": "null"} for name in names}}


def has(name: str, schema: Schema) -> Schema:
    """``name`` matches ``schema`` when it is there (left out matches too)."""
    return {"properties": {name: schema}}


def one_of(*branches: Schema) -> Schema:
    """Exactly one of ``branches``."""
    return {"oneOf": list(branches)}


def any_of(*branches: Schema) -> Schema:
    """At least one of ``branches``."""
    return {"anyOf": list(branches)}


def every(*schemas: Schema) -> Schema:
    """All of ``schemas`` at once."""
    return {"allOf": list(schemas)}


def exactly_one(first: str, second: str) -> Schema:
    """Exactly one of the fields ``first`` and ``second`` is given."""
    return one_of(every(given(first), left_out(second)), every(given(second), left_out(first)))


def at_most_one(first: str, second: str) -> Schema:
    """Not both of the fields ``first`` and ``second``."""
    return any_of(left_out(first), left_out(second))


def rules(*schemas: Schema) -> Schema:
    """``json_schema_extra`` that adds ``schemas`` to a model's document schema."""
    return {"allOf": list(schemas)}
