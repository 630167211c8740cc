"""Answering an accepted OpenAI request from its result stream: as server-sent events (``stream``), or as one
response once the result is whole. Either way the request is cancelled when the client goes away, the
request timeout passes or the stream cannot go on, so no worker keeps generating for nobody."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request

from schemas import StreamEvent, Usage
from sluicegate.api.assembler import StreamAssembler
from sluicegate.api.bodies import ChatCompletionBody, CompletionBody
from sluicegate.api.errors import ApiError, error_body
from sluicegate.api.openai_choices import ChoiceChunks, ChoicePlan
from sluicegate.api.openai_format import SSE_DONE, ResponseIds, running_usage, sse, worker_failure
from sluicegate.task_stop import cancel_and_wait

from .accept import Accepted
from .app_state import service_of
from .service import IngressService
from .telemetry import IngressMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamPart:
    """One request of a response that several requests answer (a completion's list of prompts)."""

    request_id: str
    choice_offset: int
    on_done: Callable[[Usage], object]
    # Why the response stopped this part before its end, asked as it stops: the client leaving, or another
    # part failing.
    stopped_because: Callable[[], str]


def body_events(
    request: Request,
    ids: ResponseIds,
    body: ChatCompletionBody | CompletionBody,
    accepted: Accepted,
    *,
    plan: ChoicePlan,
    accepted_at: float,
    part: StreamPart | None = None,
) -> AsyncIterator[str]:
    """:func:`sse_events` of the ``accepted`` request with the stream options of an OpenAI ``body``, its running
    usage counting the prompt ingress counted for it (a part's own prompt, for a list of prompts)."""
    service = service_of(request)
    return sse_events(
        service,
        ids,
        tenant=accepted.inference.tenant,
        include_usage=body.include_usage,
        accepted_at=accepted_at,
        metrics=service.metrics,
        plan=plan,
        continuous_usage=body.continuous_usage,
        prompt_tokens=accepted.counted_prompt_tokens,
        part=part,
    )


def stream_failure(assembler: StreamAssembler) -> ApiError | None:
    """The error to answer for a stream that ended badly, or None."""
    if assembler.error is not None:
        return worker_failure(assembler.error.code, assembler.error.message)
    if assembler.done is not None and assembler.done.finish_reason == "error":
        return ApiError(500, "The request failed on the worker.", code="worker_error")
    return None


async def collect_or_cancel(
    request: Request, service: IngressService, request_id: str, tenant: str
) -> StreamAssembler | None:
    """Wait for the whole result; cancel the request when the client leaves (returns None) or the
    request timeout passes (504)."""
    assembler = StreamAssembler()
    return assembler if await follow_or_cancel(request, service, request_id, tenant, assembler.feed) else None


async def follow_or_cancel(
    request: Request, service: IngressService, request_id: str, tenant: str, feed: Callable[[StreamEvent], object]
) -> bool:
    """Feed every event of the result to ``feed`` until it ends; cancel the request when the client leaves
    (returns False) or the request timeout passes (504)."""

    async def collect() -> bool:
        async for event in service.events(request_id, tenant, timeout_s=service.settings.request_timeout_s):
            feed(event)
        return True

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.create_task(collect())
    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(watcher, None if result.done() else result)
    if result.cancelled():
        await service.cancel(request_id, tenant, reason="client_disconnected")
        return False
    try:
        return result.result()
    except TimeoutError as exc:
        await service.cancel(request_id, tenant, reason="timeout")
        raise ApiError(504, str(exc), code="timeout") from exc


async def sse_events(
    service: IngressService,
    ids: ResponseIds,
    *,
    tenant: str,
    include_usage: bool,
    accepted_at: float,
    metrics: IngressMetrics,
    plan: ChoicePlan | None = None,
    continuous_usage: bool = False,
    prompt_tokens: int | None = None,
    part: StreamPart | None = None,
) -> AsyncIterator[str]:
    """OpenAI server-sent events for one request; cancels it when the client goes away mid-stream (or the
    relay cannot go on). As a ``part`` of a response that several requests answer, the request followed is the
    part's, its choices are numbered after the earlier parts', and it ends without the usage chunk and ``[DONE]``
    (the part's usage goes to ``part.on_done``; a part that ends without calling it failed).

    ``continuous_usage`` is vLLM's ``continuous_usage_stats``: every chunk carries the usage so far instead of
    null, counting the prompt as ``prompt_tokens`` (ingress's exact count). Where ingress could not count the
    prompt (no tokenizer published yet) the chunks before the worker's ``done`` keep null rather than guess,
    and the closing chunks carry the worker's exact figures.
    """
    cancel_reason: str | None = "client_disconnected"
    request_id = part.request_id if part is not None else ids.request_id
    offset = part.choice_offset if part is not None else 0
    first_text = True
    chunks = ChoiceChunks(plan or ChoicePlan(ids.kind))
    assembler = StreamAssembler()

    def chunk(choice: dict[str, Any]) -> str:
        usage = None
        if continuous_usage and assembler.done is not None:
            done = assembler.done.usage
            usage = running_usage(done.prompt_tokens, done.completion_tokens)
        elif continuous_usage and prompt_tokens is not None:
            usage = running_usage(prompt_tokens, assembler.completion_tokens)
        if offset:
            choice = choice | {"index": choice["index"] + offset}
        return sse(ids.choices_chunk([choice], include_usage=include_usage, usage=usage))

    # What one read of the stream gives goes out as one write: each write is a trip through the middleware and a
    # socket send, and a request's last token, its finish, usage and [DONE] often arrive together.
    pending: list[str] = []
    try:
        for choice in chunks.opening():
            yield chunk(choice)
        try:
            async for batch in service.event_batches(request_id, tenant, timeout_s=service.settings.request_timeout_s):
                for event in batch:
                    deltas = assembler.feed_choices(event)
                    if assembler.diverged:
                        cancel_reason = "stream_diverged"
                        message = "The worker restarted this request and produced different text."
                        yield "".join(pending) + sse(error_body(message, type_="server_error", code="stream_diverged"))
                        return
                    if first_text and any(d.text for d in deltas):
                        metrics.time_to_first_token.labels(ids.model).observe(time.perf_counter() - accepted_at)
                        first_text = False
                    pending.extend(chunk(choice) for choice in chunks.feed(deltas))
                if pending and not assembler.finished:  # a finished stream's chunks go out with its closing ones
                    yield "".join(pending)
                    pending.clear()
        except TimeoutError as exc:
            cancel_reason = "timeout"
            yield "".join(pending) + sse(error_body(str(exc), type_="server_error", code="timeout"))
            return
        except ApiError as exc:
            cancel_reason = "relay_failed"
            yield "".join(pending) + sse(exc.body())
            return
        cancel_reason = None
        failure = stream_failure(assembler)
        if failure is not None:
            yield "".join(pending) + sse(failure.body())
            return
        assert assembler.done is not None
        pending.extend(chunk(choice) for choice in chunks.close_all(assembler))
        if part is not None:
            part.on_done(assembler.done.usage)
            yield "".join(pending)
            return
        if include_usage:
            pending.append(sse(ids.usage_chunk(assembler.done.usage)))
        pending.append(SSE_DONE)
        yield "".join(pending)
    finally:
        if cancel_reason == "client_disconnected" and part is not None:
            cancel_reason = part.stopped_because()
        if cancel_reason is not None:
            # Free the worker. Shielded, because after a disconnect this runs inside the response's
            # cancelled scope, where any unshielded await would be cancelled at once.
            with anyio.CancelScope(shield=True), anyio.move_on_after(service.settings.kafka_timeout_s + 1):
                try:
                    await service.cancel(request_id, tenant, reason=cancel_reason)
                except Exception as exc:
                    log.warning("ingress.cancel_failed request_id=%s error=%r", request_id, exc)
