"""Building the usage ledger's records (``schemas.UsageRecord`` on ``llm.usage``) where requests end.

Exactly once per request, by an idempotent key rather than a Kafka transaction. A record is keyed by its request
id and produced at least once: the worker sends it (retried until acknowledged) after the request's ``done`` or
``error`` is in its stream and before the status record says it ended, and a worker that takes over a request
whose previous owner died before that status write sends it again (:mod:`gpu_workers.worker.serving`). The
rollup (:mod:`.rollup`) counts a request id once: ``SET NX`` of a per-request marker and the aggregate
increments in one Lua script. Why not a transaction: a request's end is spread over Redis (stream, status
record) and Kafka (results, usage), a worker commits offsets by a per-partition watermark long after a
request ends, and response-cache hits end in ingress, which consumes nothing; a transaction would cover only
part of that, while de-duplicating by request id covers every producer, including ones added later.
"""

from __future__ import annotations

from datetime import datetime

from schemas import InferenceRequest, Usage, UsageOutcome, UsageRecord, utcnow
from schemas.events import FinishReason

#: The ``producer`` of a response-cache hit's record.
RESPONSE_CACHE = "response-cache"


def outcome_of(finish_reason: FinishReason) -> UsageOutcome:
    """``finished`` for stop and length, ``cancelled`` for an abort, ``failed`` for an error."""
    if finish_reason == "abort":
        return "cancelled"
    return "failed" if finish_reason == "error" else "finished"


def _seconds(since: datetime, at: float | datetime | None) -> float | None:
    if at is None:
        return None
    moment = at.timestamp() if isinstance(at, datetime) else at
    return max(0.0, moment - since.timestamp())


def usage_record(
    request: InferenceRequest,
    *,
    producer: str,
    usage: Usage | None,
    finish_reason: FinishReason | None,
    error_code: str | None = None,
    started_at: float | None = None,
    first_output_at: float | None = None,
    finished_at: datetime | None = None,
) -> UsageRecord:
    """The ledger record of ``request``'s end: its ``usage`` (None for a failed request: nothing is counted),
    how it ended, and its timings (``started_at`` and ``first_output_at`` as unix seconds, when known)."""
    finished = finished_at or utcnow()
    outcome: UsageOutcome = "failed" if usage is None else outcome_of(finish_reason or "stop")
    prompt = usage.prompt_tokens if usage is not None else 0
    output = usage.completion_tokens if usage is not None else 0
    return UsageRecord(
        request_id=request.request_id,
        tenant=request.tenant,
        key_id=request.key_id,
        model=request.model,
        adapter=request.adapter,
        tier=request.priority,
        outcome=outcome,
        finish_reason="error" if usage is None else finish_reason,
        error_code=error_code,
        prompt_tokens=prompt,
        cached_tokens=usage.cached_tokens if usage is not None else 0,
        output_tokens=output,
        total_tokens=prompt + output,
        response_cache=bool(usage is not None and usage.cached),
        created_at=request.created_at,
        finished_at=finished,
        queue_s=_seconds(request.created_at, started_at),
        ttft_s=_seconds(request.created_at, first_output_at),
        duration_s=_seconds(request.created_at, finished) or 0.0,
        producer=producer,
    )
