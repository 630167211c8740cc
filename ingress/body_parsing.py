"""Reading a request's JSON body by hand (the publishing endpoints skip FastAPI's body handling, see
:mod:`ingress.route_without_dependencies`): 400 for malformed JSON or an unpaired surrogate, 400 naming the bad
field."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from sluicegate import json_input
from sluicegate.api.errors import ApiError, invalid

B = TypeVar("B", bound=BaseModel)


async def parse_body(request: Request, model: type[B], *, root_field: str, context: dict[str, Any] | None = None) -> B:
    """The JSON body validated as ``model`` (with pydantic's validation ``context``, for an endpoint that takes
    more than the model's other users): 400 for malformed JSON, 400 naming the bad field, 415 for a
    compressed body."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        # Read as it is, a gzip body was refused as "not valid JSON: can't decode byte 0x8b" and a mislabelled
        # one was taken; RFC 9110 says 415 for a coding the server does not apply.
        raise ApiError(
            415,
            f"Content-Encoding '{encoding}' is not supported: send the request body uncompressed.",
            code="unsupported_content_encoding",
            headers={"Accept-Encoding": "identity"},
        )
    raw = await request.body()
    try:
        data = json_input.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "Request body must be a JSON object.", code="invalid_value")
    if b"\\u" in raw and _has_lone_surrogate(data):
        raise ApiError(
            400,
            "Request body is not valid JSON text: a \\u escape encodes an unpaired UTF-16 surrogate, which is not "
            "a character.",
            code="invalid_json",
        )
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise invalid(exc, root_field=root_field) from exc


def _has_lone_surrogate(data: Any) -> bool:
    """Whether decoded JSON holds an unpaired surrogate (from an escape like ``\\ud800``); such a string cannot
    be encoded as UTF-8 for Kafka or Redis."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
