"""The native request API: ``POST /v1/requests`` queues a request and answers at once with where to stream
its result (and the token to do so); ``GET`` and ``DELETE /v1/requests/{request_id}`` read its record and
cancel it, for the tenant that submitted it only."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse

from schemas import RequestRecord
from sluicegate.api.bodies import NativeRequestBody
from sluicegate.api.errors import ApiError
from sluicegate.stream_tokens import issue_stream_token

from ..accept import SUBMIT_ERRORS, accept, answered_model, rate_headers
from ..app_state import service_of
from ..auth import ApiKey, Caller, authenticate
from ..body_parsing import parse_body
from ..openapi import CancelResponse, SubmitResponse, errors, json_body, ok
from ..route_without_dependencies import lean_post

router = APIRouter(tags=["native"])

# Same alphabet as schemas' RequestId: anything else cannot name a request.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Documented, not validated: a malformed id gets the same 404 as an unknown one.
RequestIdPath = Annotated[
    str,
    Path(json_schema_extra={"pattern": f"^{_REQUEST_ID.pattern}$"}, description="The id POST /v1/requests gave."),
]


@lean_post(
    router,
    "/v1/requests",
    status_code=202,
    openapi_extra=json_body(NativeRequestBody),
    responses=ok(SubmitResponse, status=202) | errors(*SUBMIT_ERRORS),
)
async def submit(request: Request) -> JSONResponse:
    caller = await authenticate(request)
    body = await parse_body(request, NativeRequestBody, root_field="prompt")
    accepted = await accept(request, caller, body, "/v1/requests", relayed=False)
    inference = accepted.inference
    settings = service_of(request).settings
    rid = inference.request_id
    payload = {
        "request_id": rid,
        "status": "queued",
        "model": answered_model(inference),
        "priority": inference.priority,
        "stream_url": f"{settings.public_stream_url.rstrip('/')}/v1/streams/{rid}",
        "stream_token": issue_stream_token(
            settings.stream_token_secret, rid, inference.tenant, lifetime_s=settings.stream_token_lifetime_s
        ),
    }
    return JSONResponse(payload, status_code=202, headers={"x-request-id": rid} | rate_headers(accepted))


@router.get("/v1/requests/{request_id}", responses=ok(RequestRecord) | errors(401, 404, 503))
async def request_status(request: Request, caller: Caller, request_id: RequestIdPath) -> JSONResponse:
    record = await _owned_record(request, caller, request_id)
    return JSONResponse(record.model_dump(mode="json"))


@router.delete(
    "/v1/requests/{request_id}",
    status_code=202,
    responses=ok(CancelResponse, status=202) | errors(401, 404, 409, 503),
)
async def cancel_request(request: Request, caller: Caller, request_id: RequestIdPath) -> JSONResponse:
    record = await _owned_record(request, caller, request_id)
    if record.status in ("finished", "failed", "cancelled"):
        raise ApiError(409, f"Request '{request_id}' already {record.status}.", code="request_finished")
    await service_of(request).cancel(request_id, caller.tenant, reason="client_cancelled")
    return JSONResponse({"request_id": request_id, "status": "cancelling"}, status_code=202)


async def _owned_record(request: Request, caller: ApiKey, request_id: str) -> RequestRecord:
    """The caller's request's record; 404 for an id that is malformed, unknown or another tenant's."""
    valid = _REQUEST_ID.fullmatch(request_id) is not None
    record = await service_of(request).record(request_id, caller.tenant) if valid else None
    # Another tenant's request is indistinguishable from a missing one.
    if record is None or record.tenant != caller.tenant:
        raise ApiError(404, f"No request '{request_id}'.", code="request_not_found", param="request_id")
    return record
