"""``POST /v1/embeddings``: every input accepted as its own prefill-only request (:mod:`ingress.fan_out`: the
same admission, limits, routing and Kafka topics as a completion, each counted against the key's rate limits),
then each one's ``done`` event read back for its vector, in input order: they were all queued at once, so the wait
is the slowest one's.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from sluicegate.api.embeddings import EmbeddingBody, embedding_response

from ..accept import SUBMIT_ERRORS, answered_model, rate_headers
from ..auth import authenticate
from ..body_parsing import parse_body
from ..errors import answered_under
from ..fan_out import accept_each, collect_each
from ..openapi import EmbeddingList, errors, json_body, ok
from ..route_without_dependencies import lean_post

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
    accepted = await accept_each(request, caller, body.items(), _ENDPOINT)  # one at least: a body has an input
    first = accepted[0]
    with answered_under(first.request_id):  # an input's failure, a timeout: answered under the call's id
        results = await collect_each(request, accepted)
        if results is None:
            return Response(status_code=499)  # the client left; every input is cancelled
        dones = [done for _, done in results]
        vectors = [done.embedding for done in dones]
        prompt_tokens = sum(done.usage.prompt_tokens for done in dones)
        response = embedding_response(answered_model(first.inference), vectors, prompt_tokens, body.encoding_format)
    headers = {"x-request-id": first.request_id} | rate_headers(*accepted)
    return JSONResponse(response, headers=headers)
