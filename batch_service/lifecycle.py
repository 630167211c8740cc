"""One step of a batch's life, run under the batch's lock by whichever batch worker gets there: validate, publish
the next chunks on the batch tier, notice the end, write the files, finalize; expire at the window's end; cancel.

Every step can be cut short by a crash and run again: requests have ids derived from batch id + line (a chunk
republished after a crash is the same requests, which workers recognise), progress is recorded after each
acknowledged chunk, outcomes are stored once (HSETNX), and files are rewritten under the same ids.

Token quotas (:mod:`sluicegate.usage.quota`) are checked as each chunk is published, not at validation: a line
reserves its tokens when it is about to run (a batch may span the day's reset), and a line over its key's or
tenant's quota becomes an ``insufficient_quota`` error line while the rest of the batch runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import anyio.to_thread

from router.heartbeats import read_heartbeats, read_live_models
from router.publish import request_headers, send_routed
from schemas import (
    BATCH_TERMINAL,
    BatchError,
    BatchErrors,
    InferenceRequest,
    TraceContext,
    batch_request_id,
    parse_batch_request_id,
)
from sluicegate.api.limits import Limits, model_context
from sluicegate.batches.files import StoredFile
from sluicegate.batches.lines import InputFileError
from sluicegate.batches.store import LineOutcome
from sluicegate.lora.registry import LoRARegistry
from sluicegate.lora.resolve import resolve_request
from sluicegate.telemetry import attached, context_from_traceparent
from sluicegate.usage.quota import claim_for

from .locks import RedisLock
from .metrics import eta_error
from .outcomes import outcome_from_records
from .output import write_outputs
from .prepare import chunks_from_json, chunks_json, prepare, read_prepared
from .runtime import BatchRuntime

log = logging.getLogger(__name__)

#: Seconds one step may spend publishing before it lets the tick move on to other batches.
_PUBLISH_BUDGET_S = 2.0


async def advance(runtime: BatchRuntime, batch_id: str) -> str | None:
    """Do the batch's next step if no other worker is; returns its status afterwards (None: unknown batch)."""
    lock = RedisLock(runtime.redis, runtime.names.batch_lock_key(batch_id), ttl_s=runtime.settings.batch_lock_ttl_s)
    if not await lock.acquire():
        return "locked"
    try:
        return await _step(runtime, batch_id, lock)
    finally:
        await lock.release()


async def _step(runtime: BatchRuntime, batch_id: str, lock: RedisLock) -> str | None:
    store = runtime.batches
    state = await store.state(batch_id)
    if state is None:
        await runtime.redis.zrem(runtime.names.batches_active_key, batch_id)
        return None
    status = state["status"]
    if status in BATCH_TERMINAL:
        await runtime.redis.zrem(runtime.names.batches_active_key, batch_id)
        return status
    expired = time.time() >= int(state["expires_at"])
    if status == "validating" and not expired:
        await _validate(runtime, batch_id, state)
    elif status == "in_progress" and not expired:
        await _run(runtime, batch_id, state, lock)
    elif status in ("validating", "in_progress"):
        await _end_early(runtime, batch_id, state, "batch_expired", "The batch's completion window ended first.")
    elif status == "cancelling":
        await _cancel(runtime, batch_id, state)
    elif status == "finalizing":
        await _finalize(runtime, batch_id, state)
    state = await store.state(batch_id)
    return state["status"] if state else None


async def _validate(runtime: BatchRuntime, batch_id: str, state: dict[str, str]) -> None:
    settings = runtime.settings
    raw = await runtime.redis.get(runtime.names.file_key(state["input_file_id"]))
    if raw is None:
        await _fail(runtime, batch_id, "missing_file", f"The input file {state['input_file_id']} no longer exists.")
        return
    stored = StoredFile.model_validate_json(raw)
    known = {m.decode() for m in await runtime.redis.smembers(runtime.names.models_key)}
    known |= settings.served_model_names
    # Each live model's context, which a line's max_tokens must fit in (as online; a model without a live worker
    # now is left to the worker's own check).
    live = await read_live_models(runtime.redis, runtime.names, max_age_s=3 * settings.heartbeat_interval_s)
    contexts = {model: context for model, beats in live.items() if (context := model_context(beats)) is not None}
    await runtime.routes.refresh()
    # Adapter names resolve as online (sluicegate.lora.resolve), against the registry as it is now: the prepare
    # thread gets a snapshot, not Redis.
    adapters = {a.name: a for a in await LoRARegistry(runtime.redis, runtime.names.prefix).list()}
    # Every line carries the creating request's trace (kept with the batch: the step may run in any task).
    trace = TraceContext.model_validate_json(state["trace"]) if state.get("trace") else None
    try:
        prepared = await anyio.to_thread.run_sync(
            lambda: prepare(
                runtime.files,
                batch_id=batch_id,
                input_path=stored.path,
                endpoint=state["endpoint"],
                tenant=state["tenant"],
                limits=Limits(**json.loads(state["limits"])),
                expires_at=int(state["expires_at"]),
                chunk_size=settings.batch_chunk_size,
                max_lines=settings.batch_max_lines,
                known_models=known,
                route=lambda request: runtime.routes.routed(resolve_request(adapters, request)),
                trace=trace,
                key_id=state.get("key_id"),
                contexts=contexts,
            )
        )
    except InputFileError as exc:
        await _fail(runtime, batch_id, exc.code, exc.message, line=exc.line)
        return
    for model in prepared.models:
        await runtime.topics.ensure_model(model)
    current = await runtime.batches.state(batch_id)
    if current is None or current["status"] in BATCH_TERMINAL:
        # A validation that outlived its lock, while another step ended the batch (a cancel before any line was
        # prepared): its lines must not be written into a batch that has ended.
        log.info("batch.validated_after_end batch_id=%s status=%s", batch_id, current and current["status"])
        return
    await runtime.batches.set_fields(
        batch_id, total=prepared.total, chunks=chunks_json(prepared.chunks), invalid=len(prepared.errors)
    )
    await runtime.resolve([(batch_id, line, outcome) for line, outcome in prepared.errors])
    moved = await runtime.batches.transition(batch_id, "in_progress", ("validating",))
    log.info(
        "batch.validated batch_id=%s lines=%d errors=%d chunks=%d moved=%s",
        batch_id,
        prepared.total,
        len(prepared.errors),
        len(prepared.chunks),
        moved,
    )


async def _fail(runtime: BatchRuntime, batch_id: str, code: str, message: str, *, line: int | None = None) -> None:
    errors = BatchErrors(data=[BatchError(code=code, message=message, param="input_file_id", line=line)])
    await runtime.batches.transition(batch_id, "failed", ("validating",), errors=errors.model_dump())
    log.warning("batch.failed batch_id=%s code=%s line=%s message=%s", batch_id, code, line, message)


def _counts(state: dict[str, str]) -> tuple[int, int, int]:
    """(total, resolved, enqueued lines)."""
    resolved = int(state.get("completed", 0)) + int(state.get("failed", 0))
    return int(state.get("total", 0)), resolved, int(state.get("enqueued_lines", 0))


async def _run(runtime: BatchRuntime, batch_id: str, state: dict[str, str], lock: RedisLock) -> None:
    settings = runtime.settings
    chunks = chunks_from_json(state.get("chunks"))
    done_chunks = int(state.get("enqueued", 0))
    enqueued_lines = int(state.get("enqueued_lines", 0))
    invalid = int(state.get("invalid", 0))
    started = time.monotonic()
    while done_chunks < len(chunks) and time.monotonic() - started < _PUBLISH_BUDGET_S:
        fresh = await runtime.batches.state(batch_id)
        if fresh is None or fresh["status"] != "in_progress":
            return  # cancelled meanwhile: the next step cancels
        _, resolved, _ = _counts(fresh)
        in_flight = enqueued_lines - (resolved - invalid)
        if in_flight + chunks[done_chunks].requests > settings.batch_max_in_flight and in_flight > 0:
            break
        chunk = chunks[done_chunks]
        lines = await anyio.to_thread.run_sync(read_prepared, runtime.files, batch_id, chunk.start, chunk.end)
        chunk_requests = [p.request for p in lines if p.request is not None]
        requests = await _within_quota(runtime, batch_id, state, chunk_requests)
        await _publish(runtime, requests)
        runtime.metrics.lines_enqueued.inc(len(requests))
        done_chunks += 1
        enqueued_lines += len(chunk_requests)  # a line refused for its quota is resolved: in and out at once
        await runtime.batches.set_fields(batch_id, enqueued=done_chunks, enqueued_lines=enqueued_lines)
        await lock.extend()
        log.info("batch.enqueued batch_id=%s chunk=%d/%d lines=%d", batch_id, done_chunks, len(chunks), len(requests))
    state = await runtime.batches.state(batch_id) or state
    total, resolved, _ = _counts(state)
    if done_chunks >= len(chunks) and resolved >= total:
        if await runtime.batches.transition(batch_id, "finalizing", ("in_progress",), final_status="completed"):
            await _finalize(runtime, batch_id, await runtime.batches.state(batch_id) or state)
        return
    await _sweep_if_stalled(runtime, batch_id, state, chunks[:done_chunks])


async def _prompt_tokens(runtime: BatchRuntime, request: InferenceRequest) -> int | None:
    """The line's prompt tokens as its worker will count them (the chat template's own tokens too: a chat line's
    estimate left out SmolLM2's default system prompt, and a batch ran a key past its quota); None without the
    model's published tokenizer, and the estimate stands in."""
    view = await runtime.tokenizers.get(request.model)
    if view is None:
        return None
    try:
        return len(view.encode_request(request))
    except ValueError:  # the template refuses the conversation: the worker will too, and the estimate is kept
        return None


async def _within_quota(
    runtime: BatchRuntime, batch_id: str, state: dict[str, str], requests: list[InferenceRequest]
) -> list[InferenceRequest]:
    """The chunk's requests whose tokens fit their key's and tenant's quotas now (reserved here; a line re-published
    after a crash is charged once); each of the others becomes an ``insufficient_quota`` error line at once. Lines
    that already have an outcome are not published again."""
    limits = Limits(**json.loads(state["limits"]))
    claims = []
    for request in requests:
        claim = claim_for(request, runtime.settings, key_id=request.key_id, key_limits=limits)
        if claim is not None:  # a quota is in force: reserve what the prompt really is (tokenized only then)
            exact = await _prompt_tokens(runtime, request)
            claim = claim_for(request, runtime.settings, key_id=request.key_id, key_limits=limits, prompt_tokens=exact)
        claims.append(claim)
    if all(claim is None for claim in claims):
        return requests
    lines = [batch_line(r.request_id) for r in requests]
    known = await runtime.batches.outcomes(batch_id, lines)
    admitted: list[InferenceRequest] = []
    refused: list[tuple[str, int, LineOutcome]] = []
    for request, claim, line, outcome in zip(requests, claims, lines, known, strict=True):
        if outcome is not None:
            continue
        refusal = await runtime.quotas.reserve(claim) if claim is not None else None
        if refusal is None:
            admitted.append(request)
        else:
            over = LineOutcome(status_code=429, code="insufficient_quota", message=refusal.message())
            refused.append((batch_id, line, over))
    if refused:
        await runtime.resolve(refused)
        log.info("batch.over_quota batch_id=%s lines=%d", batch_id, len(refused))
    return admitted


def batch_line(request_id: str) -> int:
    """The line number of a batch line's request id."""
    parsed = parse_batch_request_id(request_id)
    assert parsed is not None, request_id
    return parsed[1]


async def _publish(runtime: BatchRuntime, requests: list[InferenceRequest]) -> None:
    """Publish one chunk on the batch tier and wait until Kafka has acknowledged all of it."""
    producer = await runtime.producer()
    deliveries = []
    for model in {r.model for r in requests}:
        await runtime.topics.ensure_model(model)
        beats = await read_heartbeats(
            runtime.redis, runtime.names, model, max_age_s=3 * runtime.settings.heartbeat_interval_s
        )
        runtime.router.set_heartbeats(model, beats)
    for request in requests:
        route = runtime.router.route(request, max_tier="batch")
        # The producer span (and so the worker's) continues the line's own trace, not the publishing tick's.
        trace = request.trace
        parent = context_from_traceparent(trace.traceparent, trace.tracestate) if trace else None
        with attached(parent) if parent is not None else contextlib.nullcontext():
            deliveries.append(await send_routed(producer, request, route, request_headers(request)))
    await asyncio.gather(*deliveries)


async def _unresolved(runtime: BatchRuntime, batch_id: str, enqueued_only: bool) -> list[int]:
    """Lines without an outcome (only those already published with ``enqueued_only``)."""
    state = await runtime.batches.state(batch_id) or {}
    lines = await anyio.to_thread.run_sync(read_prepared, runtime.files, batch_id)
    done = await runtime.batches.resolved_lines(batch_id)
    if enqueued_only:
        chunks = chunks_from_json(state.get("chunks"))[: int(state.get("enqueued", 0))]
        end = chunks[-1].end if chunks else 0
        published = {p.line for p in await anyio.to_thread.run_sync(read_prepared, runtime.files, batch_id, 0, end)}
        return [p.line for p in lines if p.line in published and p.line not in done and p.request is not None]
    return [p.line for p in lines if p.line not in done]


async def _sweep_if_stalled(runtime: BatchRuntime, batch_id: str, state: dict[str, str], published: list) -> None:
    """Lines that failed at the worker publish no result; when no result came for a while, read the status
    records of the lines still out and store the outcome of those that ended."""
    wait = runtime.settings.batch_stall_check_s
    now_ms = time.time() * 1000
    last = max(float(state.get("last_result_at", 0)), float(state.get("last_sweep_at", 0)))
    if not published or now_ms - last < wait * 1000:
        return
    await runtime.batches.set_fields(batch_id, last_sweep_at=int(now_ms))
    found: list[tuple[str, int, LineOutcome]] = []
    for line in await _unresolved(runtime, batch_id, enqueued_only=True):
        rid = batch_request_id(batch_id, line)
        outcome = await outcome_from_records(runtime.redis, runtime.names, rid, state["tenant"])
        if outcome is not None:
            found.append((batch_id, line, outcome))
    if found:
        stored = await runtime.resolve(found)
        log.info("batch.swept batch_id=%s ended_without_result=%d stored=%d", batch_id, len(found), stored.total)


async def _cancel_lines(runtime: BatchRuntime, batch_id: str, tenant: str, reason: str) -> int:
    """Cancel every published line still out, through the one cancel path (marker + control topic)."""
    lines = await _unresolved(runtime, batch_id, enqueued_only=True)
    for start in range(0, len(lines), 200):
        group = lines[start : start + 200]
        await asyncio.gather(*(runtime.canceller.cancel(batch_request_id(batch_id, n), tenant, reason) for n in group))
    return len(lines)


async def _cancel(runtime: BatchRuntime, batch_id: str, state: dict[str, str]) -> None:
    """Stop publishing, abort what is in flight (once), wait a little for the aborts, then finish as cancelled:
    lines that finished keep their results, the rest become ``batch_cancelled`` error lines."""
    if "chunks" not in state:
        # Cancelled before it was validated: no line was prepared or published, so there is nothing to abort and
        # no output to write (reading the prepared lines would fail on every step, leaving it "cancelling").
        if await runtime.batches.transition(batch_id, "cancelled", ("cancelling",)):
            log.info("batch.cancelled batch_id=%s before_validation=true", batch_id)
        return
    if "cancel_sent_at" not in state:
        count = await _cancel_lines(runtime, batch_id, state["tenant"], "batch_cancelled")
        await runtime.batches.set_fields(batch_id, cancel_sent_at=time.time())
        log.info("batch.cancelling batch_id=%s in_flight_cancelled=%d", batch_id, count)
        state = await runtime.batches.state(batch_id) or state
    sent_at = float(state["cancel_sent_at"])
    remaining = await _unresolved(runtime, batch_id, enqueued_only=True)
    if remaining and time.time() - sent_at < runtime.settings.batch_cancel_grace_s:
        return
    await _close_out(runtime, batch_id, "batch_cancelled", "The batch was cancelled before this line finished.")
    await _write_and_end(runtime, batch_id, state, "cancelled", ("cancelling",))


async def _end_early(runtime: BatchRuntime, batch_id: str, state: dict[str, str], code: str, message: str) -> None:
    """The window ended: abort what is in flight, give every line still out an error, finalize as expired."""
    if state["status"] == "validating":
        # Never validated: there is nothing to output, only the expiry to record.
        await runtime.batches.transition(batch_id, "expired", ("validating",))
        return
    await _cancel_lines(runtime, batch_id, state["tenant"], code)
    await _close_out(runtime, batch_id, code, message)
    if await runtime.batches.transition(batch_id, "finalizing", ("in_progress",), final_status="expired"):
        await _finalize(runtime, batch_id, await runtime.batches.state(batch_id) or state)


async def _close_out(runtime: BatchRuntime, batch_id: str, code: str, message: str) -> None:
    """Give every line without an outcome the error ``code``; after this no line of the batch can change."""
    missing = await _unresolved(runtime, batch_id, enqueued_only=False)
    outcome = LineOutcome(code=code, message=message, no_response=True)
    await runtime.resolve([(batch_id, line, outcome) for line in missing])


async def _finalize(runtime: BatchRuntime, batch_id: str, state: dict[str, str]) -> None:
    final = state.get("final_status", "completed")
    await _write_and_end(runtime, batch_id, state, final, ("finalizing",))


async def _write_and_end(
    runtime: BatchRuntime, batch_id: str, state: dict[str, str], final: str, expected: tuple[str, ...]
) -> None:
    output_id, error_id = await write_outputs(runtime, batch_id, state["tenant"], state["endpoint"])
    fields = {k: v for k, v in {"output_file_id": output_id, "error_file_id": error_id}.items() if v is not None}
    if await runtime.batches.transition(batch_id, final, expected, **fields):
        done = await runtime.batches.state(batch_id) or {}
        if final == "completed":
            _record_eta_error(runtime, batch_id, done)
        log.info(
            "batch.%s batch_id=%s total=%s completed=%s failed=%s output=%s errors=%s",
            final,
            batch_id,
            done.get("total"),
            done.get("completed"),
            done.get("failed"),
            output_id,
            error_id,
        )


def _record_eta_error(runtime: BatchRuntime, batch_id: str, state: dict[str, str]) -> None:
    """How far the ETA given when a tenth of the lines were done was from the real finish (the metrics)."""
    if "eta_check_at" not in state or "eta_check_finish" not in state:
        return  # it finished before any ETA could be given at a tenth done (no rate yet, or a tiny batch)
    error = eta_error(float(state["eta_check_at"]), float(state["eta_check_finish"]), time.time())
    if error is not None:
        runtime.metrics.eta_error.observe(error)
        log.info("batch.eta_error batch_id=%s error=%.3f", batch_id, error)
