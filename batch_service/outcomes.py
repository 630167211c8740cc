"""Turning what the pipeline reports about a batch line into its :class:`LineOutcome`: a ``FinalResult`` from
``llm.results`` (a failed line's carries its error), or, for a line whose result never came (its worker died
before sending it), its status record and the ``error`` event that ended its stream."""

from __future__ import annotations

from redis.asyncio import Redis

from schemas import STREAM_FIELD, ErrorEvent, FinalResult, Names, RequestRecord, parse_stream_event
from sluicegate.api.openai_format import ERROR_STATUS
from sluicegate.batches.store import LineOutcome


def outcome_of_result(result: FinalResult) -> LineOutcome:
    """A finished request's outcome: a response, unless it was aborted (a cancel) or carries an error."""
    if result.error_code is not None:
        return worker_error(result.error_code, result.error_message or result.error_code)
    if result.finish_reason == "abort":
        return LineOutcome(result=result, code="batch_cancelled", message="The line was cancelled.", no_response=True)
    if result.finish_reason == "error":
        return worker_error("server_error", "The request failed at the worker.")
    return LineOutcome(result=result)


def worker_error(code: str, message: str) -> LineOutcome:
    """A line the worker refused or failed, with the status the online API answers for that code."""
    return LineOutcome(status_code=ERROR_STATUS.get(code, 500), code=code, message=message)


async def outcome_from_records(redis: Redis, names: Names, request_id: str, tenant: str) -> LineOutcome | None:
    """A line's outcome (of ``tenant``'s batch) from its status record and stream, when the record says it ended."""
    raw = await redis.get(names.request_key(request_id, tenant))
    if raw is None:
        return None
    record = RequestRecord.model_validate_json(raw)
    if record.status in ("finished", "cancelled") and record.result is not None:
        return outcome_of_result(record.result)
    if record.status != "failed":
        return None
    last = await redis.xrevrange(names.stream_key(request_id, tenant), count=1)
    if last:
        event = parse_stream_event(last[0][1][STREAM_FIELD.encode()])
        if isinstance(event, ErrorEvent):
            return worker_error(event.code, event.message)
    return worker_error("server_error", "The request failed at the worker.")
