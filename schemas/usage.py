"""The usage ledger's record: one per request that reached an outcome, on Kafka topic ``llm.usage``.

A request produces its record where it ends: the GPU worker that finishes, cancels or fails it, or ingress
for a response-cache hit. Records are keyed by request id and written at least once (a worker that dies
between the record and its offset commit leaves the request to another worker, which writes it again);
consumers count a request once by its ``request_id`` (the rollup does, see ``sluicegate.usage.rollup``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AwareDatetime, Field

from .common import SCHEMA_VERSION, Message, RequestId
from .events import FinishReason
from .names import Tier

#: How a request ended: ``finished`` (stop or length), ``cancelled`` (aborted by a cancel), ``failed``.
UsageOutcome = Literal["finished", "cancelled", "failed"]


class UsageRecord(Message):
    """Who used how many tokens of which model, how the request ended, and how long it took."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
    tenant: str = Field(min_length=1, max_length=128)
    key_id: str | None = Field(None, description="The API key's short id (ingress, batch); none for Kafka-native.")
    model: str = Field(min_length=1, description="The model version that served it (after routing).")
    adapter: str | None = Field(None, description="The LoRA adapter applied to the model, if any.")
    tier: Tier
    outcome: UsageOutcome
    finish_reason: FinishReason | None = None
    error_code: str | None = Field(None, description="The error event's code of a failed request.")
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(0, ge=0, description="Prompt tokens the engine's prefix cache served.")
    output_tokens: int = Field(ge=0, description="Generated tokens, every choice's.")
    total_tokens: int = Field(ge=0, description="prompt_tokens + output_tokens: what quotas count.")
    response_cache: bool = Field(False, description="Answered from ingress's response cache, not a worker.")
    created_at: AwareDatetime = Field(description="When the request was accepted.")
    finished_at: AwareDatetime
    queue_s: float | None = Field(None, ge=0, description="Accepted to taken by the worker that finished it.")
    ttft_s: float | None = Field(None, ge=0, description="Accepted to that worker's first output.")
    duration_s: float = Field(ge=0, description="Accepted to finished.")
    producer: str = Field(min_length=1, description="The worker id, or 'response-cache'.")
