"""The worker's public observation points: when it takes a Kafka record and when a Redis pipeline goes out.

Benchmarks stamp these moments to split a request's latency into stages (``benchmarks/pipeline_stack.py``);
metrics can hang off the same points. Observers run on the worker's event loop inside its hot path: they
must be cheap and must not raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from schemas import StreamEvent

from .streams import RecordWrite


class WorkerObserver(Protocol):
    """What a worker calls, if given one (``run_worker(..., observer=...)``)."""

    def record_taken(self, record: Any) -> None:
        """A request record was fetched and is about to be admitted (an aiokafka ``ConsumerRecord``)."""

    def events_sending(self, batch: Sequence[StreamEvent | RecordWrite]) -> None:
        """This batch of stream events and status-record writes is about to go to Redis in one pipeline."""
