"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: :class:`ApiError` (a status and
that body) for every request check ingress and the batch service share, and the body of a batch line's error.
Ingress turns an ``ApiError`` into its HTTP response (:mod:`ingress.errors`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sluicegate.validation_errors import summarize

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid(exc: ValidationError, *, root_field: str = "") -> ApiError:
    """400 naming the first offending field of a body that failed validation (OpenAI's and vLLM's status; FastAPI's
    own 422 would make the SDKs raise ``UnprocessableEntityError``, which OpenAI clients do not catch).

    A field the API knows but does not implement (``n`` > 1, ``tools``...) is a 400
    ``unsupported_parameter`` instead, so a client can tell "wrong value" from "not here".
    """
    field, message = summarize(exc, root_field=root_field)
    unsupported = any(e["type"] in ("unsupported", "extra_forbidden") for e in exc.errors(include_url=False))
    if unsupported:
        return ApiError(400, message, code="unsupported_parameter", param=field or None)
    return ApiError(400, message, code="invalid_value", param=field or None)
