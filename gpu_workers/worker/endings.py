"""How a request's stream ends on a worker: ``done`` with its usage and the final result, or ``error`` with a failed
result. Either is flushed to the stream before the request's offset may be committed, and neither goes further once
a newer owner has fenced the stream (the result is then that owner's to publish).
"""

from __future__ import annotations

import logging

from schemas import ChoiceResult, DoneEvent, ErrorEvent, InferenceRequest, Names, Usage, encode_embedding
from schemas.events import FinishReason

from .in_flight import Active
from .outputs import Outputs
from .stream_state import read_pickup_state

log = logging.getLogger(__name__)


class Endings:
    """Writes a request's last event and result; counts the requests served."""

    def __init__(self, outputs: Outputs, names: Names) -> None:
        self.outputs = outputs
        self.names = names
        self.served = 0

    async def finish(
        self,
        entry: Active,
        request: InferenceRequest,
        seq: int,
        reason: FinishReason,
        tokens: list[int],
        text: str,
        prompt_tokens: int,
        cached: int,
        choices: list[ChoiceResult] | None = None,
        embedding: list[float] | None = None,
    ) -> bool:
        """End the stream with ``done`` (its usage; an embedding's vector) and publish the final result; False when
        it was handed off or fenced meanwhile."""
        completion = sum(len(c.token_ids) for c in choices) if choices else len(tokens)
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            cached_tokens=cached,
        )
        entry.used_tokens = usage.total_tokens  # what the intake's fair queue settles the tenant's start to
        vector = encode_embedding(embedding) if embedding is not None else None
        done = DoneEvent(request_id=request.request_id, seq=seq, finish_reason=reason, usage=usage, embedding=vector)
        if not self.outputs.emit(entry, done):
            return False
        if entry.watch is not None:
            entry.watch.finished(reason, usage, entry.first_output_wall)
        # The stream must hold ``done`` before the offset can be committed.
        await self.outputs.flush()
        if entry.fenced:  # a newer owner refused the ``done``: the result is its to publish
            return False
        await self.outputs.publish_result(request, done, tokens, text, choices, entry, epoch=entry.epoch or 0)
        self.served += 1
        # One line per request served, as ingress's "ingress.published": an operator follows a request id across
        # the services' logs.
        log.info(
            "worker.finished",
            extra={
                "request_id": request.request_id,
                "finish_reason": reason,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "cached_tokens": cached,
            },
        )
        return True

    async def fail(
        self, entry: Active, code: str, message: str, seq: int | None = None, request: InferenceRequest | None = None
    ) -> bool:
        """End the request's stream with an ``error`` event (and, given the request, its failed result and usage
        record); False when it was handed off meanwhile."""
        request_id = entry.request_id
        if seq is None or entry.epoch is None:  # failed before (or in) its pick-up: take it over first
            pickup = await read_pickup_state(self.outputs.publisher, self.names, request_id, tenant=entry.tenant)
            entry.epoch, seq = pickup.epoch, pickup.stream.next_seq
        if not self.outputs.emit(entry, ErrorEvent(request_id=request_id, seq=seq, code=code, message=message[:2000])):
            return False
        if entry.watch is not None:
            entry.watch.failed(code)
        await self.outputs.flush()
        if entry.fenced:
            return False
        log.info("worker.failed", extra={"request_id": request_id, "code": code})
        result = None
        if request is not None:
            result = await self.outputs.publish_failure(request, entry, code, message[:2000])
        await self.outputs.mark_failed(request_id, entry.tenant, entry.epoch or 0, result)
        return True
