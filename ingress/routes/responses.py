"""OpenAI's Responses API: ``POST /v1/responses`` (whole, streamed, or ``background``: queued and answered at
once), ``GET /v1/responses/{id}`` (as it stands, or its events with ``stream=true``, from ``starting_after``),
``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A response is a chat completion underneath (:mod:`ingress.responses.bodies`): accepted, queued on Kafka and
served like one, its answer read from the request's Redis stream. A stored response (``store``, the default)
belongs to the caller's tenant; any other tenant gets the same 404 as for a response that does not exist.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from redis.exceptions import RedisError

from sluicegate.api.errors import ApiError
from sluicegate.api.openai_format import worker_failure
from sluicegate.api.tool_calls import plan_for

from ..accept import SUBMIT_ERRORS, accept, answered_model, rate_headers
from ..app_state import service_of
from ..auth import ApiKey, Caller, authenticate
from ..body_parsing import parse_body
from ..errors import answered_under, unavailable
from ..openai_stream import follow_or_cancel
from ..openapi import errors, json_body, ok
from ..responses.bodies import RESPONSE_ID, ResponseCreateBody, chat_body, echo_fields, responses_error
from ..responses.docs import InputItemList, ResponseDeleted, response_ok
from ..responses.events import ResponseEvents
from ..responses.items import chat_messages, stored_items, with_ids
from ..responses.objects import PlanSpec, ResponseRecord
from ..responses.relay import cancelled, current, sse_events, stream_exists
from ..responses.store import ResponseStore, Stored, not_found
from ..route_without_dependencies import lean_post

router = APIRouter(tags=["responses"])

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_ENDED = frozenset({"finished", "cancelled", "failed"})
# How long a cancel waits for the worker to end the response, so that it answers the settled object (last text,
# usage); a running request ends within a step or two of the cancel reaching its worker.
_CANCEL_SETTLE_S = 2.0
_CANCEL_QUEUED_S = 0.5

# Documented, not validated: a malformed id gets the same 404 as an unknown one.
ResponseIdPath = Annotated[str, Path(json_schema_extra={"pattern": f"^{RESPONSE_ID.pattern}$"})]
# Nothing can be included: the document offers only the empty list (its validator answers 400 unsupported_parameter
# to any other).
Include = Annotated[
    list[str] | None, Query(description="Not supported beyond nothing.", json_schema_extra={"maxItems": 0})
]


def store_of(request: Request) -> ResponseStore:
    """The app's response store (made in the lifespan)."""
    store: ResponseStore = request.app.state.responses
    return store


@lean_post(
    router,
    "/v1/responses",
    openapi_extra=json_body(ResponseCreateBody),
    responses=response_ok() | errors(*SUBMIT_ERRORS, 409, 500, 504),
)
async def create_response(request: Request) -> Response:
    caller = await authenticate(request)
    body = await parse_body(request, ResponseCreateBody, root_field="input")
    if body.background and not body.stored:
        raise ApiError(
            400,
            "background: true needs store: true (a background response is kept to be polled or streamed).",
            code="unsupported_parameter",
            param="background",
        )
    service, store = service_of(request), store_of(request)
    history, chain = await _conversation(request, caller, body.previous_response_id)
    given = stored_items(body.input)  # type: ignore[arg-type]
    chat = chat_body(body, chat_messages(history + given, body.instructions))
    try:
        accepted = await accept(request, caller, chat, "/v1/responses", relayed=not body.background)
    except ApiError as exc:
        raise responses_error(exc) from None  # with the refusal's headers: its x-request-id among them
    inference = accepted.inference
    rid = inference.request_id
    with answered_under(rid):  # a worker's failure, a timeout: answered under the request's id
        record = ResponseRecord(
            id=f"resp_{rid}",
            request_id=rid,
            tenant=caller.tenant,
            created_at=int(inference.created_at.timestamp()),
            model=answered_model(inference),
            background=bool(body.background),
            echo=echo_fields(body),
            plan=PlanSpec.of(plan_for(chat.tools, chat.tool_choice, accepted.tool_call_format)),
            input_items=with_ids(given, rid),
            chain=chain,
        )
        if body.stored:
            try:
                await store.create(record)
            except (RedisError, OSError) as exc:
                # Queued but not recorded: take the request back, so a retry does not run it twice.
                await service.cancel(rid, caller.tenant, reason="record_failed")
                raise unavailable("Redis", exc, request_id=rid) from exc
        headers = {"x-request-id": rid} | rate_headers(accepted)
        if body.stream:
            events = sse_events(
                service, record, store=store if body.stored else None, cancel_on_disconnect=not body.background
            )
            return StreamingResponse(events, media_type="text/event-stream", headers=headers | _SSE_HEADERS)
        builder = ResponseEvents(record)
        if body.background:
            return JSONResponse(builder.response(), headers=headers)
        if not await follow_or_cancel(request, service, rid, caller.tenant, builder.feed):
            return Response(status_code=499)  # the client left; nobody reads this
        response = builder.response()
        if body.stored:
            await store.finalize(record, response)
        if builder.failure is not None:
            raise worker_failure(*builder.failure)
        return JSONResponse(response, headers=headers)


async def _conversation(
    request: Request, caller: ApiKey, previous: str | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The items of the conversation ``previous`` ends (every earlier response's input and output, oldest
    first) and the chain of response ids it is; 404 when one is gone, 400 while ``previous`` is still running."""
    if previous is None:
        return [], []
    store = store_of(request)
    stored = await store.get(caller.tenant, previous)
    if stored is None:
        raise not_found(previous, "previous_response_id")
    response, final = await current(service_of(request), store, stored)
    if not final:
        raise ApiError(
            400,
            f"Previous response '{previous}' is still {response['status']}; continue it once it has ended.",
            code="previous_response_not_finished",
            param="previous_response_id",
        )
    chain = stored.record.chain
    items: list[dict[str, Any]] = []
    for response_id, earlier in zip(chain, await store.get_many(caller.tenant, chain), strict=True):
        if earlier is None or earlier.final is None:
            raise not_found(response_id, "previous_response_id")
        items += earlier.record.input_items + earlier.final["output"]
    items += stored.record.input_items + response["output"]
    return items, [*chain, previous]


async def _owned(request: Request, caller: ApiKey, response_id: str) -> Stored:
    """The caller's stored response; 404 for an id that is malformed, unknown, expired or another tenant's."""
    stored = await store_of(request).get(caller.tenant, response_id) if RESPONSE_ID.fullmatch(response_id) else None
    if stored is None:
        raise not_found(response_id)
    return stored


def _nothing_included(include: list[str] | None) -> None:
    if include:
        raise ApiError(
            400, f"include is not supported ({', '.join(include)}).", code="unsupported_parameter", param="include"
        )


@router.get("/v1/responses/{response_id}", responses=response_ok() | errors(400, 401, 404, 503))
async def retrieve_response(
    request: Request,
    caller: Caller,
    response_id: ResponseIdPath,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0, description="Stream the events after this one.")] = None,
    include: Include = None,
    include_obfuscation: bool | None = None,
) -> Response:
    _nothing_included(include)
    stored = await _owned(request, caller, response_id)
    service, store = service_of(request), store_of(request)
    headers = {"x-request-id": stored.record.request_id}
    if not stream:
        response, _ = await current(service, store, stored)
        return JSONResponse(response, headers=headers)
    if not await stream_exists(service, stored.record.request_id, stored.record.tenant):
        _, final = await current(service, store, stored)
        if final:
            raise ApiError(
                400,
                f"The events of response '{response_id}' are no longer kept (they are for SLUICEGATE_STREAM_TTL_S "
                "after it ends); retrieve it without stream.",
                code="stream_expired",
                param="stream",
            )
    events = sse_events(service, stored.record, store=store, starting_after=starting_after, cancel_on_disconnect=False)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers | _SSE_HEADERS)


@router.post("/v1/responses/{response_id}/cancel", responses=response_ok() | errors(400, 401, 404, 503))
async def cancel_response(request: Request, caller: Caller, response_id: ResponseIdPath) -> JSONResponse:
    stored = await _owned(request, caller, response_id)
    if not stored.record.background:
        raise ApiError(
            400, "Only responses created with background: true can be cancelled.", code="invalid_request", param=None
        )
    service, store = service_of(request), store_of(request)
    response, final = await current(service, store, stored)
    if not final:
        await store.mark_cancelled(stored.record)
        await service.cancel(stored.record.request_id, caller.tenant, reason="client_cancelled")
        response = await _settled(request, caller, response_id, response)
    return JSONResponse(response, headers={"x-request-id": stored.record.request_id})


async def _settled(request: Request, caller: ApiKey, response_id: str, response: dict[str, Any]) -> dict[str, Any]:
    """The cancelled response as its worker ends it (its last text and its usage), when that comes within
    ``_CANCEL_SETTLE_S``; else ``response`` marked cancelled. Only the request's status record is polled (one small
    read, not the whole stream). A request still "queued" after ``_CANCEL_QUEUED_S`` is taken as one no worker has
    started (a worker ends it only when it meets it in its queue): not sooner, since a worker that has just started
    it writes "running" with its first flush, and a cancel answered before that was rewritten by the worker's end
    (a token and its usage appeared under the "cancelled" the client had been given)."""
    service = service_of(request)
    stored = await _owned(request, caller, response_id)
    started = time.monotonic()
    while time.monotonic() - started < _CANCEL_SETTLE_S:
        record = await service.record(stored.record.request_id, stored.record.tenant)
        if record is None or (record.status == "queued" and time.monotonic() - started >= _CANCEL_QUEUED_S):
            break
        if record.status in _ENDED:
            settled, final = await current(service, store_of(request), stored)
            if final:
                return settled
        await asyncio.sleep(0.05)
    cancelled(response)
    return response


@router.delete("/v1/responses/{response_id}", responses=ok(ResponseDeleted) | errors(401, 404, 503))
async def delete_response(request: Request, caller: Caller, response_id: ResponseIdPath) -> dict[str, Any]:
    stored = await _owned(request, caller, response_id)
    service = service_of(request)
    if stored.final is None:
        status = await service.record(stored.record.request_id, stored.record.tenant)
        if status is not None and status.status not in _ENDED:  # nobody could read it any more: stop it
            await service.cancel(stored.record.request_id, caller.tenant, reason="client_cancelled")
    await store_of(request).delete(stored.record)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", responses=ok(InputItemList) | errors(400, 401, 404, 503))
async def list_input_items(
    request: Request,
    caller: Caller,
    response_id: ResponseIdPath,
    after: Annotated[
        str | None,
        Query(max_length=256, description="List the items after this item id, which must be one of the response's."),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Include = None,
) -> dict[str, Any]:
    _nothing_included(include)
    stored = await _owned(request, caller, response_id)
    items = stored.record.input_items if order == "asc" else stored.record.input_items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(
                400, f"No input item '{after}' in response '{response_id}'.", code="invalid_value", param="after"
            )
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
