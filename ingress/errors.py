"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure ingress
reports, so OpenAI clients raise their usual exception classes with a readable message; a backbone that does
not answer is a 503 with ``Retry-After``. An error about an accepted request carries that request's id itself
(:func:`answered_under`), so the handlers need nothing but the error.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sluicegate.api.errors import ApiError

log = logging.getLogger(__name__)


def error_response(exc: ApiError) -> JSONResponse:
    """The HTTP response of ``exc``: its status, its OpenAI-shaped body and its headers, always with an
    ``x-request-id``: the error's own (the request it is about, :func:`answered_under`), else a fresh one that only
    this answer and its log line carry (the SDKs show it as the error's ``request_id``, so a user can quote it
    and an operator find it)."""
    headers = exc.headers or {}
    request_id = headers.get("x-request-id")
    if request_id is None:
        request_id = uuid.uuid4().hex
        headers = {"x-request-id": request_id} | headers
    log.info("ingress.refused status=%d code=%s request_id=%s", exc.status, exc.code, request_id)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


@contextmanager
def answered_under(request_id: str) -> Iterator[None]:
    """Every ``ApiError`` raised inside names ``request_id`` (its ``x-request-id``) unless it names a request of its
    own: the request an HTTP call accepted (the first, for a call of several), so a refusal, a worker's failure or
    a timeout is answered under the id a client and an operator can look up."""
    try:
        yield
    except ApiError as exc:
        headers = exc.headers or {}
        if "x-request-id" not in headers:
            # A new dict: an error's headers may be a dict its raiser keeps.
            exc.headers = {"x-request-id": request_id} | headers
        raise


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
        return error_response(exc)

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        # A check of the body as a whole names no field: its own sentence, without pydantic's "Value error, ".
        said = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        message = f"'{param}': {said}" if param else said
        return error_response(ApiError(400, message, code="invalid_value", param=param))

    async def redis_error(_: Request, exc: Exception) -> JSONResponse:
        # Redis not answering is the backbone being away, not a bug: the same 503 + Retry-After as the request
        # path's own checks give, for every route that reads or writes Redis without catching (files, batches).
        return error_response(unavailable("Redis", exc))

    async def client_left(_: Request, exc: Exception) -> Response:
        # The client hung up while still sending its body: nothing was accepted and nobody reads an answer; 499
        # (as for a client that leaves mid-answer) keeps it out of the 5xx counts and the error log.
        return Response(status_code=499)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    app.add_exception_handler(RedisError, redis_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
