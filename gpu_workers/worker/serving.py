"""One request's life on a worker: claim it, start the engine early, read its pickup state, then skip,
resume, generate or refuse it, and finish it with ``done`` (or ``error``) and a final result (:mod:`.endings`).

:meth:`Serving.serve` answers whether the request reached an outcome, which is what lets its offset be
committed (:mod:`.intake`); a request handed to another owner mid-way has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from gpu_workers.engine import EngineFront, RequestStream
from schemas import (
    InferenceRequest,
    Names,
    RestartEvent,
    TokenEvent,
    tier_rank,
)
from schemas.events import FinishReason
from sluicegate.record_check import Rejection, request_id_of
from sluicegate.telemetry import attached

from .adapters import AdapterError, Adapters, lora_kwargs, resolve_adapter
from .choice_resume import ChoiceResume
from .choices import ChoiceTracker
from .control import Cancels
from .endings import Endings
from .in_flight import Active, InFlight
from .outputs import Outputs
from .prompts import LogprobText, PromptError, prompt_len_or_zero, prompt_token_ids, sampling_params
from .resume import Continuation
from .stream_state import read_pickup_state
from .telemetry import WorkerTelemetry

log = logging.getLogger(__name__)


class Serving:
    """Serves the requests the intake admits, one task each."""

    def __init__(
        self,
        engine: EngineFront,
        names: Names,
        redis: aioredis.Redis,
        outputs: Outputs,
        in_flight: InFlight,
        cancels: Cancels,
        adapters: Adapters | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.names = names
        self.redis = redis
        self.outputs = outputs
        self.in_flight = in_flight
        self.cancels = cancels
        self._eos_ids = engine.eos_token_ids
        self._logprob_text = LogprobText(engine.tokenizer)
        # Set when the engine itself failed: the fetch loop stops the worker rather than take more work.
        self.fatal: BaseException | None = None
        self.endings = Endings(outputs, names)
        # Counters for logs and tests.
        self.resumed = 0
        self.cancelled_before_start = 0
        self.telemetry: WorkerTelemetry | None = None  # set by the Worker

    @property
    def served(self) -> int:
        """Requests that reached ``done`` here."""
        return self.endings.served

    async def serve(self, record: Any, entry: Active, parsed: InferenceRequest | Rejection | Exception) -> bool:
        """Serve one record; True once it reached an outcome (``done``/``error`` in its stream, a dead letter,
        or skipped as a duplicate or as already finished). Anything else is re-delivered to the partition's
        next owner."""
        provisional = entry.provisional_key
        try:
            if isinstance(parsed, Exception):
                raise parsed
            if isinstance(parsed, Rejection):
                await self.outputs.dead_letter(record, parsed)
                return True
            if entry.request_id != parsed.request_id and not await self.in_flight.claim(entry, parsed.request_id):
                return True  # a duplicate of a request this worker is running
            entry.reader, entry.tenant = parsed.reader, parsed.tenant
            if self.telemetry is None:
                return await self._serve_request(parsed, entry, record)
            entry.watch = self.telemetry.watch(parsed, record)
            span_context = entry.watch.context()
            if span_context is None:
                return await self._serve_request(parsed, entry, record)
            with attached(span_context):  # Redis and Kafka calls of this task nest under the request's span
                return await self._serve_request(parsed, entry, record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self.engine.is_running:
                # The engine itself is gone: leave the request to a healthy worker and stop this one.
                log.error("worker.engine_failed", extra={"error": repr(exc)})
                self.fatal = exc
                return False
            log.exception("worker.request_failed", extra={"offset": record.offset})
            if entry.request_id != provisional:
                message = f"the worker failed to serve the request: {exc!r}"
                failed = parsed if isinstance(parsed, InferenceRequest) else None
                try:
                    await self.endings.fail(entry, "internal_error", message, None, failed)
                except Exception as fail_exc:  # the same Redis fault, most often: the dead letter still goes out
                    log.error(
                        "worker.failure_unrecorded",
                        extra={"request_id": entry.request_id, "error": repr(fail_exc), "cause": repr(exc)},
                    )
            rid = request_id_of(record.value, record.headers)
            rejection = Rejection("processing_failed", repr(exc), rid, entry.tenant)
            await self.outputs.dead_letter(record, rejection)
            return True
        finally:
            if entry.watch is not None:
                entry.watch.close()
                entry.watch = None
            self.in_flight.release(entry)

    async def _serve_request(self, request: InferenceRequest, entry: Active, record: Any) -> bool:
        """Serve one parsed request; True when it reached an outcome, False when handed off mid-way.

        The engine starts on the request while its pickup state is read from Redis, so that round trip
        overlaps the prefill instead of preceding it. Nothing the early start produces is emitted before the
        state says the request is new; otherwise the early start is withdrawn and the state decides.
        """
        if entry.early is None:
            entry.early = self.start_early(request, entry)
        try:
            return await self._serve_picked_up(request, entry, record)
        finally:
            if entry.early is not None:
                await self._withdraw(entry.early)
                entry.early = None

    def start_early(self, request: InferenceRequest, entry: Active) -> RequestStream | None:
        """Start the engine on a request that looks new; None when anything says it should wait."""
        rid = request.request_id
        if entry.cancelled or entry.handed_off or self.cancels.pending(rid, request.reader) or request.expired():
            return None
        if request.adapter is not None:
            # Early only when the adapter needs no I/O (looked up recently and loaded); else the task resolves it.
            entry.lora = self.adapters.ready(request) if self.adapters is not None else None
            if entry.lora is None:
                return None
        try:
            entry.prompt = prompt_token_ids(request, self.engine.tokenizer)
            return self.engine.add_request(
                entry.prompt,
                sampling_params(request, 0),
                request_id=rid,
                priority=tier_rank(request.priority),
                tenant=request.tenant,
                deadline=request.deadline_epoch(),
                pooling=request.embedding_pooling,
                **lora_kwargs(entry.lora),
            )
        except (PromptError, ValueError):
            return None  # the regular path reports it, after the pickup state is known

    async def _withdraw(self, stream: RequestStream) -> None:
        """Abort an engine request nobody will read and wait for its end, so its id is free again."""
        if stream.finished:
            return
        with contextlib.suppress(Exception):
            await self.engine.abort(stream.request_id)
            async for _ in stream:
                pass

    async def _serve_picked_up(self, request: InferenceRequest, entry: Active, record: Any) -> bool:
        rid = request.request_id
        # A reader seen lapsed is asked after once more: its lease may be back (the same ingress renewed it) before
        # the next check of the reader watch would see it.
        reader = request.reader
        gone = self.cancels.reader_is_gone(reader)
        lease_key = self.names.reader_key(reader) if gone and reader is not None else None
        pickup = await read_pickup_state(self.outputs.publisher, self.names, rid, lease_key, tenant=request.tenant)
        entry.epoch = pickup.epoch  # this worker now owns the request: its writes carry the epoch (.fencing)
        if pickup.lease_exists and reader is not None:
            self.cancels.reader_back(reader)
        state, ended_before = pickup.stream, pickup.ended_before
        if state.finished:
            # Re-delivered after it finished but before its offset was committed.
            log.info("worker.already_finished", extra={"request_id": rid})
            self._redelivered(request, "already_finished")
            if state.done is not None and not ended_before:
                # The previous owner died between ``done`` and its final result: publish that now
                # (llm.results is at-least-once, keyed by request id).
                await self.outputs.publish_result(request, state.done, state.token_ids, state.text, epoch=pickup.epoch)
            elif state.error is not None and not ended_before:  # died between ``error`` and its status record
                await self.outputs.publish_failure(request, None, state.error.code, state.error.message)
            return True
        if not state.exists and ended_before:
            return True  # it finished long ago and its stream expired
        seq = state.next_seq
        if self.cancels.requested(entry, pickup.cancel_marked):
            self.cancelled_before_start += 1
            why = "reader_gone" if self.cancels.reader_is_gone(reader) else "cancelled"
            log.info(
                "worker.cancelled_before_start", extra={"request_id": rid, "delivered": state.delivered, "reason": why}
            )
            prompt_len = prompt_len_or_zero(request, self.engine.tokenizer)
            return await self.endings.finish(entry, request, seq, "abort", state.token_ids, state.text, prompt_len, 0)
        if not state.exists and request.expired():
            # Checked here, not when the record was parsed: the deadline is about starting, and only the
            # stream tells whether a re-delivered request already started (then it is continued).
            assert request.deadline is not None
            detail = f"deadline {request.deadline.isoformat()} passed before the request started"
            if not await self.endings.fail(
                entry, "deadline_exceeded", "the request's deadline passed before it started", seq, request
            ):
                return False
            await self.outputs.dead_letter(record, Rejection("deadline_exceeded", detail, rid, request.tenant))
            return True
        try:
            prompt = entry.prompt if entry.prompt is not None else prompt_token_ids(request, self.engine.tokenizer)
        except PromptError as exc:
            if not await self.endings.fail(entry, "invalid_request", str(exc), seq, request):
                return False
            await self.outputs.dead_letter(record, Rejection("invalid_prompt", str(exc), rid, request.tenant))
            return True
        unservable = await self._use_adapter(request, entry) if request.adapter is not None else None
        if unservable is not None:  # unknown here, or its files would not load: this request fails, nothing else
            if not await self.endings.fail(entry, unservable.code, str(unservable), seq, request):
                return False
            await self.outputs.dead_letter(record, Rejection(unservable.code, str(unservable), rid, request.tenant))
            return True

        resumed: Continuation | ChoiceResume | None = None
        if state.delivered:
            tokenizer = self.engine.tokenizer
            if request.sampling.n > 1:
                resumed = ChoiceResume(request, tokenizer, prompt, state, self._eos_ids, self._logprob_text, entry.lora)
            else:
                resumed = Continuation(request, tokenizer, prompt, state.token_ids, state.text, self._eos_ids)
            if not resumed.consistent:
                # The delivered text is not what this model's tokenizer makes of the delivered tokens, so
                # no seamless continuation exists: start over and tell clients to drop what they have.
                log.warning("worker.restart", extra={"request_id": rid, "delivered": state.delivered})
                self._redelivered(request, "restarted")
                if not self.outputs.emit(entry, RestartEvent(request_id=rid, seq=seq, discard_after_seq=-1)):
                    return False
                seq += 1
                resumed = None
            else:
                self.resumed += 1
                self._redelivered(request, "resumed")
                log.info("worker.resuming", extra={"request_id": rid, "delivered": state.delivered, "seq": seq})
                ended = resumed.finished_already() if isinstance(resumed, Continuation) else None
                if ended is not None:
                    # The previous owner died between the last token and ``done``.
                    resumed.close(ended)
                    tail = resumed.take(final=True)
                    if tail:
                        if not self.outputs.emit(entry, TokenEvent(request_id=rid, seq=seq, text=tail, token_ids=[])):
                            return False
                        seq += 1
                    return await self.endings.finish(
                        entry, request, seq, ended, resumed.token_ids, resumed.text, len(prompt), 0
                    )
        return await self._generate(request, entry, record, prompt, seq, resumed)

    async def _use_adapter(self, request: InferenceRequest, entry: Active) -> AdapterError | None:
        """Resolve the request's LoRA adapter into ``entry.lora``; the error that fails the request otherwise."""
        try:
            lora = await resolve_adapter(self.adapters, request, self.outputs.redis_call)
        except AdapterError as exc:
            return exc
        if entry.early is not None and entry.lora != lora:  # registered anew since the early start
            await self._withdraw(entry.early)
            entry.early = None
        entry.lora = lora
        return None

    async def _generate(
        self,
        request: InferenceRequest,
        entry: Active,
        record: Any,
        prompt: list[int],
        seq: int,
        resumed: Continuation | ChoiceResume | None,
    ) -> bool:
        rid = request.request_id
        if resumed is not None and entry.early is not None:
            await self._withdraw(entry.early)  # it started from the bare prompt; the resume needs more
            entry.early = None
        # Written with the first token's append rather than awaited here: one round trip less before the
        # engine starts, and still ahead of the final record (which waits for a flush). Not waking the flush
        # loop, which would otherwise send it alone before the engine's first step.
        if not self.outputs.emit(entry, self.outputs.record_write(request, "running"), wake=False):
            return False
        if isinstance(resumed, ChoiceResume):  # n > 1: each open choice from its own delivered tokens
            end = await resumed.run(
                self.engine, entry, seq, functools.partial(self.outputs.emit, entry), self._withdraw
            )
            if end is None or entry.handed_off:
                return False
            reason, tokens, text, results = resumed.outcome(request.sampling.logprobs is not None)
            return await self.endings.finish(entry, request, end, reason, tokens, text, len(prompt), 0, results)
        delivered = list(resumed.token_ids) if resumed is not None else []
        tokens, text = list(delivered), resumed.text[: resumed.sent] if resumed is not None else ""
        finish: FinishReason = "stop"
        embedding: list[float] | None = None  # an embedding request's vector (its one delta carries it)
        cached = 0
        started = False
        opts = request.sampling
        tracker = ChoiceTracker(opts.n, self._logprob_text) if opts.n > 1 or opts.logprobs is not None else None
        # No await between this check and the engine taking the request (an early start has it already;
        # ``add_request`` queues it at once), so a cancel is either seen here or reaches the engine.
        if entry.cancelled:
            return await self.endings.finish(entry, request, seq, "abort", tokens, text, len(prompt), 0)
        try:
            deltas, entry.early = entry.early, None
            if deltas is None:
                params = sampling_params(request, len(delivered), delivered)
                deltas = self.engine.add_request(
                    prompt + delivered,
                    params,
                    request_id=rid,
                    priority=tier_rank(request.priority),
                    tenant=request.tenant,
                    deadline=request.deadline_epoch(),
                    pooling=request.embedding_pooling,
                    **lora_kwargs(entry.lora),
                )
            if entry.watch is not None:
                entry.watch.generating()
            async with self._reading(deltas):
                async for delta in deltas:
                    started = entry.produced = True
                    entry.first_output_wall = entry.first_output_wall or time.time()
                    if delta.final is not None and entry.watch is not None:
                        entry.watch.engine_finished(delta.final.metrics)
                    if entry.handed_off:
                        return False
                    cached = getattr(delta, "num_cached_tokens", cached) or cached
                    embedding = delta.embedding or embedding
                    if opts.n > 1:
                        assert tracker is not None
                        choice_event = tracker.event(rid, seq, delta)
                        if choice_event is not None:
                            if not self.outputs.emit(entry, choice_event):
                                return False
                            seq += 1
                        if tracker.all_ended:
                            finish = tracker.finish_reason()
                            break
                        continue
                    reason: FinishReason | None = delta.finish_reason
                    if resumed is None:
                        piece = delta.text
                        tokens.extend(delta.token_ids)
                    else:
                        if resumed.feed(delta.token_ids):
                            reason = "stop"  # a stop string across the resume point: the engine cannot see it
                        if reason is not None:
                            resumed.close(reason)
                        piece = resumed.take(final=reason is not None)
                        tokens = resumed.token_ids
                    text += piece
                    logprobs = tracker.add(0, delta.token_ids, piece, delta.logprobs) if tracker else None
                    if piece or delta.token_ids:
                        event = TokenEvent(
                            request_id=rid, seq=seq, text=piece, token_ids=list(delta.token_ids), logprobs=logprobs
                        )
                        if not self.outputs.emit(entry, event):
                            return False
                        seq += 1
                    if reason is not None:
                        finish = reason
                        break  # leaving the block aborts the engine request if it is still running
        except ValueError as exc:
            if started:
                raise
            # The engine refused the request outright (e.g. prompt + max_tokens over the context length).
            code = "context_length_exceeded" if "max_model_len" in str(exc) else "invalid_request"
            if not await self.endings.fail(entry, code, str(exc), seq, request):
                return False
            await self.outputs.dead_letter(record, Rejection("rejected_by_engine", str(exc), rid, request.tenant))
            return True
        if entry.handed_off:
            return False
        choices = None
        if tracker is not None:
            choices = tracker.results(finish, opts.logprobs is not None)
            if opts.n > 1:
                tokens, text = tracker.first()
        return await self.endings.finish(
            entry, request, seq, finish, list(tokens), text, len(prompt), cached, choices, embedding
        )

    def _redelivered(self, request: InferenceRequest, outcome: str) -> None:
        if self.telemetry is not None:
            self.telemetry.redelivered(request.priority, outcome)

    @contextlib.asynccontextmanager
    async def _reading(self, stream: RequestStream) -> AsyncIterator[RequestStream]:
        """Read an engine request's deltas; leaving early (a stop string, a hand-off, an error) aborts it.

        The request's task ends only once the engine has let go of the id: a partition handed off and assigned
        back re-delivers the same request, which must find the id free (with an engine process the abort's
        answer takes a round trip, so the old task would otherwise be gone while the engine still held it).
        """
        try:
            yield stream
        finally:
            await self._withdraw(stream)
