"""``POST /v1/completions`` with a list of prompts: each prompt is its own request (:mod:`ingress.fan_out`), and
the answer puts their choices together as OpenAI and vLLM do. Prompt ``i``'s choice ``j`` has index ``i * n + j``,
and the usage is the sum of the prompts'. The response's id is the first prompt's request id; the
``x-request-ids`` header lists every prompt's.

Streamed, the parts' chunks go out as each part produces them, interleaved; one usage chunk (with
``include_usage``) and one ``[DONE]`` close the stream once every part has finished. A part that fails ends the
stream with its error, and the other parts are cancelled, as is every part when the client leaves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from schemas import Usage
from sluicegate.api.bodies import CompletionBody
from sluicegate.api.openai_choices import ChoicePlan, whole_choices
from sluicegate.api.openai_format import SSE_DONE, ResponseIds, sse
from sluicegate.task_stop import cancel_and_wait

from .accept import Accepted, answered_model, rate_headers
from .auth import ApiKey
from .errors import answered_under
from .fan_out import accept_each, collect_each
from .openai_stream import StreamPart, body_events

_ENDPOINT = "/v1/completions"


def summed_usage(usages: list[Usage]) -> Usage:
    """The usage of a response that several requests answered."""
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        total_tokens=sum(u.total_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
    )


async def answer_prompts(request: Request, caller: ApiKey, body: CompletionBody) -> Response:
    """Accept every prompt of ``body``, then answer them together, whole or streamed."""
    accepted_at = time.perf_counter()
    accepted = await accept_each(request, caller, body.one_per_prompt(), _ENDPOINT)
    first = accepted[0].inference
    ids = ResponseIds("completion", first.request_id, answered_model(first), int(time.time()))
    n = first.sampling.n
    plan = ChoicePlan("completion", n=n, logprobs=first.sampling.logprobs is not None)
    # Every part's id too (``x-request-ids``, in prompt order), so a client can follow or cancel each one.
    headers = {"x-request-id": first.request_id, "x-request-ids": ",".join(a.request_id for a in accepted)}
    headers |= rate_headers(*accepted)
    if body.stream:
        events = _merged_events(request, accepted, ids, plan, body, accepted_at)
        headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    with answered_under(first.request_id):  # a part's failure, a timeout: answered under the call's id
        results = await collect_each(request, accepted)
        if results is None:
            return Response(status_code=499)  # the client left; every prompt is cancelled
        choices = [
            choice | {"index": position * n + choice["index"]}
            for position, (assembler, _) in enumerate(results)
            for choice in whole_choices(assembler, plan)
        ]
        usage = summed_usage([done.usage for _, done in results])
    return JSONResponse(ids.choices_response(choices, usage), headers=headers)


async def _merged_events(
    request: Request,
    accepted: list[Accepted],
    ids: ResponseIds,
    plan: ChoicePlan,
    body: CompletionBody,
    accepted_at: float,
) -> AsyncIterator[str]:
    """Every part's chunks as they come, then the closing usage chunk and ``[DONE]``."""
    usages: dict[int, Usage] = {}
    stop_reason = "client_disconnected"  # until a part fails: then the others stop because it did
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(position: int, accepted_part: Accepted) -> None:
        part = StreamPart(
            accepted_part.request_id,
            position * plan.n,
            on_done=lambda usage: usages.__setitem__(position, usage),
            stopped_because=lambda: stop_reason,
        )
        events = body_events(request, ids, body, accepted_part, plan=plan, accepted_at=accepted_at, part=part)
        try:
            async for text in events:
                queue.put_nowait((position, text))
        finally:
            queue.put_nowait((position, None))

    pumps = [asyncio.create_task(pump(position, each)) for position, each in enumerate(accepted)]
    running = len(pumps)
    try:
        while running:
            position, text = await queue.get()
            if text is not None:
                yield text
                continue
            running -= 1
            if position not in usages:
                stop_reason = "sibling_failed"
                return  # that part failed and said so in its last event: the others are cancelled below
        if body.include_usage:
            yield sse(ids.usage_chunk(summed_usage(list(usages.values()))))
        yield SSE_DONE
    finally:
        # Each part cancels its request as it stops. Shielded: after a disconnect this runs in a cancelled scope.
        with anyio.CancelScope(shield=True):
            await cancel_and_wait(*pumps)
