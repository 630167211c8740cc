"""One call that is several requests (an embeddings call's inputs, a completion's list of prompts): every part
accepted as its own request (the same admission, limits, routing and Kafka topics; each counts against the key's
rate limits, as each is one request on the queue), a few at a time. When one part is refused (too long for the
context, say) no more are queued, those already queued are cancelled, and the refusal is the answer. Results
are read back in order (all were queued at once, so the wait is the slowest one's); one that fails, or the client
leaving, cancels the rest. The call is known by its first part's request id: its answer's ``x-request-id``, and the
one its refusal names."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import Request

from schemas import DoneEvent
from sluicegate.api.assembler import StreamAssembler
from sluicegate.api.bodies import AnyBody

from .accept import Accepted, admit, new_request_id
from .app_state import service_of
from .auth import ApiKey
from .errors import answered_under
from .openai_stream import collect_or_cancel, stream_failure

# Parts of one call accepted at a time: each takes Redis and Kafka round trips, and a 2048-part call must not take
# every connection of the pool at once.
ACCEPT_CONCURRENCY = 16


async def accept_each(request: Request, caller: ApiKey, bodies: Sequence[AnyBody], endpoint: str) -> list[Accepted]:
    """Every body accepted, in order; on the first refusal the others are withdrawn and it is raised, under the
    first part's request id."""
    if not bodies:
        return []
    gate = asyncio.Semaphore(ACCEPT_CONCURRENCY)
    refusals: list[BaseException] = []
    ids = [new_request_id() for _ in bodies]  # up front: the first names the call whichever part is refused

    async def accept_one(body: AnyBody, request_id: str) -> Accepted | None:
        async with gate:
            if refusals:
                return None  # one part was refused: the call fails, so queue no more
            try:
                return await admit(request, caller, body, endpoint, request_id=request_id)
            except BaseException as exc:
                refusals.append(exc)
                return None

    with answered_under(ids[0]):
        outcomes = await asyncio.gather(*(accept_one(body, rid) for body, rid in zip(bodies, ids, strict=True)))
        accepted = [o for o in outcomes if o is not None]
        if refusals:
            await cancel_each(request, accepted, reason="sibling_refused")
            raise refusals[0]
    return accepted


async def cancel_each(request: Request, accepted: Sequence[Accepted], *, reason: str) -> None:
    """Withdraw parts queued for an answer that will not be given."""
    service = service_of(request)
    await asyncio.gather(
        *(service.cancel(a.request_id, a.inference.tenant, reason=reason) for a in accepted), return_exceptions=True
    )


async def collect_each(
    request: Request, accepted: Sequence[Accepted]
) -> list[tuple[StreamAssembler, DoneEvent]] | None:
    """Each part's whole result and its ``done``, in order, each finished well; None when the client left. A part
    that failed is raised (as its own answer would be) after the parts not read yet are cancelled."""
    service = service_of(request)
    results: list[tuple[StreamAssembler, DoneEvent]] = []
    for position, part in enumerate(accepted):
        rest = accepted[position + 1 :]
        try:
            assembler = await collect_or_cancel(request, service, part.request_id, part.inference.tenant)
        except BaseException:
            await cancel_each(request, rest, reason="sibling_refused")
            raise
        if assembler is None:  # the client left (this part is cancelled already)
            await cancel_each(request, rest, reason="client_disconnected")
            return None
        failure = stream_failure(assembler)
        if failure is not None:
            await cancel_each(request, rest, reason="sibling_refused")
            raise failure
        assert assembler.done is not None  # ended, and not with an error: stream_failure would have said
        results.append((assembler, assembler.done))
    return results
