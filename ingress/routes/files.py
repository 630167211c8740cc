"""The OpenAI Files API, for batch input and output files: ``POST /v1/files`` (multipart, ``purpose=batch``;
the JSONL is checked line by line before it is stored), ``GET /v1/files``, ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content`` and ``DELETE /v1/files/{id}``. A file belongs to the caller's tenant; any other
tenant gets the same 404 as for a file that does not exist.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from schemas import FileObject
from sluicegate.api.errors import ApiError
from sluicegate.batches.files import FileStore, StoredFile, file_object, new_file_id
from sluicegate.batches.lines import InputFileError, check_input_file

from ..auth import Caller
from ..openapi import errors

router = APIRouter(tags=["files"])

_CHUNK = 256 * 1024


def file_store(request: Request) -> FileStore:
    """The app's file store (made in the lifespan)."""
    store: FileStore = request.app.state.files
    return store


def not_found(file_id: str) -> ApiError:
    """The one answer for a file that is missing or another tenant's."""
    return ApiError(404, f"No such File object: {file_id}", code="not_found", param="file_id")


async def owned_file(request: Request, caller: Caller, file_id: str) -> StoredFile:
    """The caller's file ``file_id``, or 404."""
    stored = await file_store(request).get(file_id, caller.tenant)
    if stored is None:
        raise not_found(file_id)
    return stored


@router.post("/v1/files", response_model=FileObject, responses=errors(400, 401, 413, 503))
async def upload_file(
    request: Request,
    caller: Caller,
    file: Annotated[
        UploadFile,
        File(
            description="The JSONL batch input file: one request per line ({custom_id, method, url, body}), unique "
            "custom_ids, one url for all. A file that is not is a 400 naming the first bad line (invalid_json_line, "
            "invalid_request_line, duplicate_custom_id, mixed_endpoints, too_many_lines, empty_file)."
        ),
    ],
    # Checked by the endpoint (for its own error code); the document lists the one value it takes.
    purpose: Annotated[str, Form(description='Only "batch" is accepted.', json_schema_extra={"enum": ["batch"]})],
) -> FileObject:
    if purpose != "batch":
        raise ApiError(
            400,
            f"Invalid purpose {purpose!r}: this server stores batch input files only (purpose 'batch').",
            code="invalid_purpose",
            param="purpose",
        )
    settings = request.app.state.settings
    store = file_store(request)
    limit = settings.batch_max_file_bytes
    size = file.size if file.size is not None else 0
    if size > limit:
        raise ApiError(
            413, f"File is {size} bytes, above the limit of {limit} bytes.", code="file_too_large", param="file"
        )
    file_id = new_file_id()
    path = store.path_for(file_id)

    def check_and_store() -> tuple[int, int, str | None]:
        file.file.seek(0)
        summary = check_input_file(file.file, max_lines=settings.batch_max_lines)
        return store.copy_in(file.file, path), summary.lines, summary.endpoint

    try:
        written, lines, endpoint = await anyio.to_thread.run_sync(check_and_store)
    except InputFileError as exc:
        raise ApiError(exc.status, exc.message, code=exc.code, param="file") from exc
    stored = StoredFile(
        file=file_object(file_id, size=written, filename=file.filename or "batch.jsonl", purpose="batch"),
        tenant=caller.tenant,
        path=path,
        lines=lines,
        endpoint=endpoint,
    )
    try:
        await store.register(stored)
    except BaseException:
        # Unregistered, the stored copy could never be listed, read or deleted: do not leave it behind.
        await anyio.to_thread.run_sync(store.remove, path)
        raise
    return stored.file


@router.get("/v1/files", responses=errors(400, 401, 503))
async def list_files(
    request: Request,
    caller: Caller,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    purpose: str | None = None,
) -> dict[str, Any]:
    files, has_more = await file_store(request).list(caller.tenant, after=after, limit=limit, purpose=purpose)
    return {
        "object": "list",
        "data": [f.model_dump() for f in files],
        "first_id": files[0].id if files else None,
        "last_id": files[-1].id if files else None,
        "has_more": has_more,
    }


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=errors(401, 404, 503))
async def get_file(request: Request, caller: Caller, file_id: str) -> FileObject:
    return (await owned_file(request, caller, file_id)).file


@router.get("/v1/files/{file_id}/content", responses=errors(401, 404, 503))
async def file_content(request: Request, caller: Caller, file_id: str) -> StreamingResponse:
    stored = await owned_file(request, caller, file_id)
    store = file_store(request)
    handle = await anyio.to_thread.run_sync(store.open_read, stored.path)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while chunk := await anyio.to_thread.run_sync(handle.read, _CHUNK):
                yield chunk
        finally:
            await anyio.to_thread.run_sync(handle.close)

    headers = {"content-length": str(stored.file.bytes)}
    return StreamingResponse(chunks(), media_type="application/jsonl", headers=headers)


@router.delete("/v1/files/{file_id}", responses=errors(401, 404, 503))
async def delete_file(request: Request, caller: Caller, file_id: str) -> dict[str, Any]:
    stored = await owned_file(request, caller, file_id)
    await file_store(request).delete(stored)
    return {"id": file_id, "object": "file", "deleted": True}
