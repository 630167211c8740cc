"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure ingress
reports, so OpenAI clients raise their usual exception classes with a readable message; a backbone that does
not answer is a 503 with ``Retry-After``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluicegate.validation_errors import summarize

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
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

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid(exc: ValidationError, *, root_field: str = "") -> ApiError:
    """422 naming the first offending field of a body that failed validation.

    A field the API knows but does not implement (``n`` > 1, ``tools``...) is a 400
    ``unsupported_parameter`` instead, so a client can tell "wrong value" from "not here".
    """
    field, message = summarize(exc, root_field=root_field)
    unsupported = any(e["type"] in ("unsupported", "extra_forbidden") for e in exc.errors(include_url=False))
    if unsupported:
        return ApiError(400, message, code="unsupported_parameter", param=field or None)
    return ApiError(422, message, code="invalid_value", param=field or None)


def unavailable(what: str, exc: BaseException, *, request_id: str | None = None) -> ApiError:
    """503 + ``Retry-After`` for a backbone that did not answer; ``request_id`` names a request whose publish
    failed (a worker will not serve it even if the record reaches Kafka later)."""
    detail = str(exc) or type(exc).__name__
    headers = {"Retry-After": "1"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return ApiError(503, f"{what} is unavailable: {detail}", code="service_unavailable", headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error (ours, routing 404/405, FastAPI's own validation) through the OpenAI shape."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return ApiError(422, f"'{param}': {first.get('msg', 'invalid')}", code="invalid_value", param=param).response()

    async def redis_error(_: Request, exc: Exception) -> JSONResponse:
        # Redis not answering is the backbone being away, not a bug: the same 503 + Retry-After as the request
        # path's own checks give, for every route that reads or writes Redis without catching (files, batches).
        return unavailable("Redis", exc).response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RedisError, redis_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
