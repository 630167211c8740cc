"""``POST /v1/embeddings``: every input accepted as its own prefill-only request (the same admission, limits,
routing and Kafka topics as a completion), then each one's ``done`` event read back for its vector.

Inputs are accepted together; when one is refused (too long for the context, say) the others already queued are
cancelled and the refusal is the answer. Results are read in input order: they were all queued at once, so the
wait is the slowest one's.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from schemas import DoneEvent, InferenceRequest
from sluicegate.api.embeddings import EmbeddingBody, embedding_response

from ..accept import SUBMIT_ERRORS, accept
from ..app_state import service_of
from ..auth import authenticate
from ..body_parsing import parse_body
from ..lean_route import lean_post
from ..openai_stream import collect_or_cancel, stream_failure
from ..openapi import EmbeddingList, errors, json_body, ok

router = APIRouter(tags=["openai"])

_ENDPOINT = "/v1/embeddings"


@lean_post(
    router,
    _ENDPOINT,
    openapi_extra=json_body(EmbeddingBody),
    responses=ok(EmbeddingList) | errors(*SUBMIT_ERRORS, 409, 500, 504),
)
async def embeddings(request: Request) -> Response:
    caller = await authenticate(request)
    body = await parse_body(request, EmbeddingBody, root_field="input")
    service = service_of(request)
    outcomes = await asyncio.gather(
        *(accept(request, caller, item, _ENDPOINT) for item in body.items()), return_exceptions=True
    )
    accepted = [o for o in outcomes if isinstance(o, InferenceRequest)]
    refused = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if refused is not None:
        await _cancel(request, accepted)
        raise refused
    dones: list[DoneEvent] = []
    for position, inference in enumerate(accepted):
        try:
            assembler = await collect_or_cancel(request, service, inference.request_id, inference.tenant)
        except BaseException:
            await _cancel(request, accepted[position + 1 :])
            raise
        if assembler is None:  # the client left (this one is cancelled already)
            await _cancel(request, accepted[position + 1 :])
            return Response(status_code=499)
        failure = stream_failure(assembler)
        if failure is not None:
            await _cancel(request, accepted[position + 1 :])
            raise failure
        assert assembler.done is not None
        dones.append(assembler.done)
    model = accepted[0].model if accepted else body.model
    headers = {"x-request-id": accepted[0].request_id} if accepted else {}
    return JSONResponse(embedding_response(model, dones, body.encoding_format), headers=headers)


async def _cancel(request: Request, accepted: list[InferenceRequest]) -> None:
    """Withdraw inputs queued for an answer that will not be given."""
    service = service_of(request)
    await asyncio.gather(
        *(service.cancel(i.request_id, i.tenant, reason="sibling_refused") for i in accepted), return_exceptions=True
    )
