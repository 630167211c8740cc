"""The OpenAI Batches API: ``POST /v1/batches`` (an uploaded ``purpose=batch`` file, its endpoint, the "24h"
window, metadata), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel`` and ``GET /v1/batches`` (``after``,
``limit``). A new batch is kicked to the batch workers at once; their beat advances it from then on. A batch
belongs to the caller's tenant; any other tenant gets the same 404 as for a batch that does not exist.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from schemas import BATCH_ENDPOINTS, Batch
from sluicegate.api.errors import ApiError
from sluicegate.batches.celery_app import kick
from sluicegate.batches.store import BatchStore
from sluicegate.telemetry import current_trace

from ..auth import Caller
from ..openapi import errors
from .files import file_store

log = logging.getLogger(__name__)

router = APIRouter(tags=["batches"])


class CreateBatchBody(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, description="An uploaded purpose=batch file of the caller's tenant.")
    # Checked by the endpoint (for its own error codes); the document lists the values it takes.
    endpoint: str = Field(
        json_schema_extra={"enum": list(BATCH_ENDPOINTS)}, description="The endpoint every line of the file targets."
    )
    completion_window: str = Field(json_schema_extra={"enum": ["24h"]})
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16
    )


def batch_store(request: Request) -> BatchStore:
    """The app's batch store (made in the lifespan)."""
    store: BatchStore = request.app.state.batches
    return store


def not_found(batch_id: str) -> ApiError:
    """The one answer for a batch that is missing or another tenant's."""
    return ApiError(404, f"No such Batch object: {batch_id}", code="not_found", param="batch_id")


@router.post("/v1/batches", response_model=Batch, responses=errors(400, 401, 404, 503))
async def create_batch(request: Request, caller: Caller, body: CreateBatchBody) -> Batch:
    if body.endpoint not in BATCH_ENDPOINTS:
        raise ApiError(
            400,
            f"Invalid endpoint {body.endpoint!r}: a batch targets one of {', '.join(BATCH_ENDPOINTS)}.",
            code="invalid_endpoint",
            param="endpoint",
        )
    if body.completion_window != "24h":
        raise ApiError(
            400,
            f"Invalid completion_window {body.completion_window!r}: only '24h' is supported.",
            code="invalid_completion_window",
            param="completion_window",
        )
    stored = await file_store(request).get(body.input_file_id, caller.tenant)
    if stored is None:
        raise ApiError(404, f"No such File object: {body.input_file_id}", code="not_found", param="input_file_id")
    if stored.file.purpose != "batch":
        raise ApiError(
            400,
            f"File {body.input_file_id} has purpose {stored.file.purpose!r}; a batch needs a 'batch' input file.",
            code="invalid_input_file",
            param="input_file_id",
        )
    if stored.endpoint != body.endpoint:
        raise ApiError(
            400,
            f"The file's lines target {stored.endpoint!r} but the batch's endpoint is {body.endpoint!r}.",
            code="endpoint_mismatch",
            param="endpoint",
        )
    settings = request.app.state.settings
    batch = await batch_store(request).create(
        tenant=caller.tenant,
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        metadata=body.metadata,
        limits=caller.limits.resolve(settings),
        key_id=caller.key_id,
        trace=current_trace(),
    )
    log.info(
        "batch.created batch_id=%s tenant=%s file=%s lines=%d", batch.id, caller.tenant, stored.file.id, stored.lines
    )
    # The beat would find it within a tick anyway; the kick saves that wait. Sending is a blocking broker call.
    try:
        await anyio.to_thread.run_sync(kick, settings, batch.id)
    except Exception as exc:  # the broker being away must not lose a batch that is already recorded
        log.warning("batch.kick_failed batch_id=%s error=%r", batch.id, exc)
    return batch


@router.get("/v1/batches/{batch_id}", response_model=Batch, responses=errors(401, 404, 503))
async def get_batch(request: Request, caller: Caller, batch_id: str) -> Batch:
    batch = await batch_store(request).get(batch_id, caller.tenant)
    if batch is None:
        raise not_found(batch_id)
    return batch


@router.post("/v1/batches/{batch_id}/cancel", response_model=Batch, responses=errors(401, 404, 409, 503))
async def cancel_batch(request: Request, caller: Caller, batch_id: str) -> Batch:
    store = batch_store(request)
    batch = await store.get(batch_id, caller.tenant)
    if batch is None:
        raise not_found(batch_id)
    if not await store.request_cancel(batch_id):
        current = await store.get(batch_id, caller.tenant)
        assert current is not None
        if current.status in ("cancelling", "cancelled"):
            return current
        raise ApiError(
            409,
            f"Batch {batch_id} is {current.status} and can no longer be cancelled.",
            code="batch_not_cancellable",
            param="batch_id",
        )
    log.info("batch.cancel_requested batch_id=%s tenant=%s", batch_id, caller.tenant)
    settings = request.app.state.settings
    try:
        await anyio.to_thread.run_sync(kick, settings, batch_id)
    except Exception as exc:
        log.warning("batch.kick_failed batch_id=%s error=%r", batch_id, exc)
    current = await store.get(batch_id, caller.tenant)
    assert current is not None
    return current


@router.get("/v1/batches", responses=errors(400, 401, 503))
async def list_batches(
    request: Request,
    caller: Caller,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    batches, has_more = await batch_store(request).list(caller.tenant, after=after, limit=limit)
    return {
        "object": "list",
        "data": [b.model_dump() for b in batches],
        "first_id": batches[0].id if batches else None,
        "last_id": batches[-1].id if batches else None,
        "has_more": has_more,
    }
