"""Continuing a request with several choices (``n`` > 1) after a re-delivery: every choice from the tokens its
stream already delivered, as a one-choice request continues (:mod:`.resume`), instead of starting over.

The engine forks a request's choices from one prompt, but resumed choices each have their own prefix (the
prompt plus that choice's delivered tokens), so each unfinished choice runs as a one-choice engine request
``<request id>#<index>``; their common prompt blocks are shared through the engine's prefix cache. Each keeps
a :class:`.resume.Continuation` (text that joins seamlessly, stop strings across the resume point, the
grammar replayed past its delivered tokens) and, when seeded, the seed ``seed + index`` its choice had (its
draws are keyed by that seed and the position, so each choice draws what the first run drew). Choices that
ended before the crash stay ended; one whose delivered tokens already end it ends now.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gpu_workers.engine import EngineFront, RequestDelta, RequestStream
from gpu_workers.engine.lora.request import LoRARequest
from schemas import ChoiceResult, InferenceRequest, StreamEvent, TokenEvent, tier_rank
from schemas.events import FinishReason
from sluicegate.task_stop import cancel_and_wait

from .adapters import lora_kwargs
from .choices import ChoiceTracker
from .in_flight import Active
from .prompts import LogprobText, sampling_params
from .resume import Continuation
from .stream_state import DeliveredChoice, StreamState


class ChoiceResume:
    """The choices of one resumed request: those still open, each with its continuation, and the tracker
    that holds every choice for the final result."""

    def __init__(
        self,
        request: InferenceRequest,
        tokenizer: Any,
        prompt: list[int],
        state: StreamState,
        eos_ids: frozenset[int],
        logprob_text: LogprobText,
        lora: LoRARequest | None = None,
    ) -> None:
        self.request = request
        self.lora = lora  # the request's adapter: every resumed choice runs with it
        self.prompt = prompt
        self.tracker = ChoiceTracker(request.sampling.n, logprob_text)
        self.open: dict[int, Continuation] = {}
        # False when some choice's delivered text is not what this tokenizer makes of its tokens: then no
        # seamless continuation exists and the request starts over.
        self.consistent = True
        for index in range(request.sampling.n):
            delivered = state.choices.get(index, DeliveredChoice())
            self.tracker.restore(index, delivered.token_ids, delivered.text, delivered.finish_reason)
            if delivered.finish_reason is not None:
                continue
            continuation = Continuation(request, tokenizer, prompt, delivered.token_ids, delivered.text, eos_ids)
            self.consistent = self.consistent and continuation.consistent
            self.open[index] = continuation

    def outcome(self, keep_logprobs: bool) -> tuple[FinishReason, list[int], str, list[ChoiceResult]]:
        """The request's end (choice 0's), choice 0's tokens and text, and every choice for the final result."""
        tokens, text = self.tracker.first()
        return self.tracker.finish_reason(), tokens, text, self.tracker.results("abort", keep_logprobs)

    def engine_id(self, index: int) -> str:
        return f"{self.request.request_id}#{index}"

    async def run(
        self,
        engine: EngineFront,
        entry: Active,
        seq: int,
        emit: Callable[[StreamEvent], bool],
        withdraw: Callable[[RequestStream], Awaitable[None]],
    ) -> int | None:
        """Run the open choices to their ends, emitting their events from ``seq``; the next seq, or None when
        the request was handed off (``emit`` answered False) meanwhile."""
        for index, continuation in list(self.open.items()):
            ended = continuation.finished_already()  # the first run died between its last token and its end
            if ended is not None:
                event = self._event(seq, index, [], None, ended)
                if event is not None:
                    if not emit(event):
                        return None
                    seq += 1
        if not self.open:
            return seq
        if entry.cancelled:
            for index in list(self.open):
                event = self._event(seq, index, [], None, "abort")
                if event is not None:
                    if not emit(event):
                        return None
                    seq += 1
            return seq
        entry.engine_ids = tuple(self.engine_id(i) for i in self.open)  # what a cancel or hand-off aborts
        async with contextlib.AsyncExitStack() as stack:
            streams = {}
            for index in self.open:
                streams[index] = self._start(engine, index)
                stack.push_async_callback(withdraw, streams[index])
            merged = await stack.enter_async_context(contextlib.aclosing(_merged(streams)))
            # Closed before the streams are withdrawn (the exit stack unwinds in reverse), so no pump still
            # reads a stream that a withdrawal drains.
            async for index, delta in merged:
                if entry.handed_off:
                    return None
                if index not in self.open:
                    continue  # cut by a stop string across the resume point; its abort is on its way
                event = self._event(seq, index, delta.token_ids, delta.logprobs, delta.finish_reason)
                if event is not None:
                    if not emit(event):
                        return None
                    seq += 1
                if index not in self.open and not delta.finished:
                    await engine.abort(self.engine_id(index))
                if not self.open:
                    break
        return seq

    def _start(self, engine: EngineFront, index: int) -> RequestStream:
        delivered = self.open[index].token_ids
        params = sampling_params(self.request, len(delivered), delivered)
        seed = None if params.seed is None else params.seed + index
        return engine.add_request(
            self.prompt + delivered,
            dataclasses.replace(params, n=1, seed=seed),
            request_id=self.engine_id(index),
            priority=tier_rank(self.request.priority),
            tenant=self.request.tenant,
            deadline=self.request.deadline_epoch(),
            **lora_kwargs(self.lora),
        )

    def _event(
        self, seq: int, index: int, token_ids: list[int], logprobs: object, reason: str | None
    ) -> TokenEvent | None:
        """A choice's new tokens as a stream event, its text relative to what was delivered; closes the choice
        when it ends."""
        continuation = self.open[index]
        finish: FinishReason | None = reason  # type: ignore[assignment]
        if continuation.feed(token_ids):
            finish = "stop"  # a stop string across the resume point: the engine cannot see it
        if finish is not None:
            continuation.close(finish)
            del self.open[index]
        piece = continuation.take(final=finish is not None)
        rid = self.request.request_id
        return self.tracker.choice_event(rid, seq, index, token_ids, piece, logprobs, finish)


async def _merged(streams: dict[int, RequestStream]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """The deltas of several engine streams as they come, each with its choice's index."""
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(index, stream)) for index, stream in streams.items()]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        await cancel_and_wait(*pumps)
