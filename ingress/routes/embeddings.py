"""``POST /v1/embeddings``: every input accepted as its own prefill-only request (the same admission, limits,
routing and Kafka topics as a completion), then each one's ``done`` event read back for its vector.

Inputs are accepted together, a few at a time; when one is refused (too long for the context, say) no more are
queued, those already queued are cancelled, and the refusal is the answer. Results are read in input order: they
were all queued at once, so the wait is the slowest one's. Each input counts as one request against the key's
rate limits, as each is one request on the queue.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from schemas import DoneEvent, InferenceRequest
from sluicegate.api.bodies import EmbeddingInput
from sluicegate.api.embeddings import EmbeddingBody, embedding_response

from ..accept import SUBMIT_ERRORS, accept, answered_model
from ..app_state import service_of
from ..auth import authenticate
from ..body_parsing import parse_body
from ..lean_route import lean_post
from ..openai_stream import collect_or_cancel, stream_failure
from ..openapi import EmbeddingList, errors, json_body, ok

router = APIRouter(tags=["openai"])

_ENDPOINT = "/v1/embeddings"
# Inputs of one call accepted at a time: each takes Redis and Kafka round trips, and a 2048-input call must not
# take every connection of the pool at once.
_ACCEPT_CONCURRENCY = 16


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
    gate = asyncio.Semaphore(_ACCEPT_CONCURRENCY)
    refusals: list[BaseException] = []

    async def accept_one(item: EmbeddingInput) -> InferenceRequest | None:
        async with gate:
            if refusals:
                return None  # one input was refused: the call fails, so queue no more
            try:
                return await accept(request, caller, item, _ENDPOINT)
            except BaseException as exc:
                refusals.append(exc)
                return None

    outcomes = await asyncio.gather(*(accept_one(item) for item in body.items()))
    accepted = [o for o in outcomes if o is not None]
    if refusals:
        await _cancel(request, accepted)
        raise refusals[0]
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
    model = answered_model(accepted[0]) if accepted else body.model
    headers = {"x-request-id": accepted[0].request_id} if accepted else {}
    vectors = [done.embedding for done in dones]
    prompt_tokens = sum(done.usage.prompt_tokens for done in dones)
    return JSONResponse(embedding_response(model, vectors, prompt_tokens, body.encoding_format), headers=headers)


async def _cancel(request: Request, accepted: list[InferenceRequest]) -> None:
    """Withdraw inputs queued for an answer that will not be given."""
    service = service_of(request)
    await asyncio.gather(
        *(service.cancel(i.request_id, i.tenant, reason="sibling_refused") for i in accepted), return_exceptions=True
    )
