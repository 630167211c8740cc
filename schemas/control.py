"""Control-plane messages: cancellations, worker heartbeats, final results and dead letters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field

from .common import SCHEMA_VERSION, Message, RequestId, utcnow
from .events import FinishReason, Usage
from .generation import ReasoningParser, TokenLogprob, ToolCallFormat
from .names import Tier
from .requests import TraceContext


class CancelRequest(Message):
    """Asks the worker that owns (or will pick up) a request to stop it and free its KV blocks."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
    tenant: str = "default"
    reason: str = Field("client_cancelled", max_length=256)
    created_at: AwareDatetime = Field(default_factory=utcnow)


class PartitionRef(Message):
    """One topic partition."""

    topic: str
    partition: int = Field(ge=0)


class WorkerHeartbeat(Message):
    """What a worker reports every few seconds: ownership, load and cache state."""

    schema_version: Literal[1] = SCHEMA_VERSION
    worker_id: str = Field(min_length=1)
    model: str = Field(min_length=1)
    partitions: list[PartitionRef] = Field(default_factory=list)
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    free_kv_blocks: int = Field(ge=0)
    total_kv_blocks: int = Field(ge=0)
    prefix_cache_hit_rate: float = Field(ge=0.0, le=1.0)
    device: str = "cpu"
    draining: bool = False
    sent_at: AwareDatetime = Field(default_factory=utcnow)
    max_model_len: int | None = Field(None, ge=1, description="The engine's context length (prompt + output).")
    tool_call_format: ToolCallFormat | None = Field(None, description="How the model writes tool calls.")
    reasoning_parser: ReasoningParser | None = Field(
        None, description="How the model's output splits into reasoning and answer (None: it is all answer)."
    )
    architecture: str | None = Field(
        None, max_length=128, description="The engine's architecture of the model (e.g. Qwen3ForCausalLM)."
    )
    description: str | None = Field(None, description="What the worker says of its model (e.g. random weights).")
    backlog_seconds: dict[Tier, Annotated[float, Field(ge=0)]] | None = Field(
        None,
        description="Seconds of generation waiting in Kafka at or above each tier on this worker's partitions, beyond "
        "what fits the engine's free batch seats (the sluicegate_worker_backlog_seconds gauge); a tier without a "
        "finite estimate is left out. Admission refuses a deadline that not even the least loaded worker's figure "
        "meets.",
    )
    adapters: list[str] = Field(
        default_factory=list, description="Names of the LoRA adapters loaded on this worker (CPU pool or device)."
    )
    kv_events_seq: int | None = Field(
        None,
        ge=0,
        description="The seq of this worker's latest KVCacheEvents (None: it publishes none); a reader whose copy is "
        "behind it by more than a heartbeat has lost events.",
    )
    lora: bool = Field(False, description="Whether this worker serves LoRA adapters (loads registered ones on demand).")
    deterministic: bool = Field(
        False,
        description="Whether the worker's engine runs batch-invariant: a request's greedy and seeded tokens do not "
        "depend on its batch, chunking, prefix-cache hits or preemption (SLUICEGATE_DETERMINISTIC).",
    )
    arithmetic: str | None = Field(
        None,
        max_length=300,
        description="What the worker's numbers depend on besides the model's files (device, how steps run, thread "
        "count, precision, torch version). Deterministic workers give a request the same bits only where this is "
        "the same.",
    )

    @property
    def serves_adapters(self) -> bool:
        """It can serve a request for an adapter: LoRA is on (a worker listing adapters has it on, whatever its
        version said)."""
        return self.lora or bool(self.adapters)


class ModelTokenizer(Message):
    """A model's tokenizer as its workers publish it to Redis at start: enough for ingress, which has no model
    files, to count a prompt's tokens exactly as the worker will (the ``tokenizers`` library's JSON and the chat
    template with the tokens it names)."""

    model: str = Field(min_length=1)
    digest: str = Field(min_length=1, description="sha256 of tokenizer_json and chat_template: changes on a new one.")
    tokenizer_json: str = Field(min_length=2, description="The Hugging Face tokenizers library's tokenizer.json.")
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    max_model_len: int | None = Field(None, ge=1)


class ChoiceResult(Message):
    """One choice of a finished request (``n`` > 1, or logprobs asked for)."""

    index: int = Field(ge=0)
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None


class FinalResult(Message):
    """A finished request, as written to the durable ``llm.results`` topic."""

    schema_version: Literal[1] = SCHEMA_VERSION
    request_id: RequestId
    model: str
    tenant: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    error_code: str | None = None
    error_message: str | None = None
    choices: list[ChoiceResult] | None = Field(
        None, description="Every choice, when n > 1 or logprobs were asked for; text/token_ids are choice 0's."
    )
    embedding: str | None = Field(None, description="An embedding request's vector: base64 of little-endian float32.")
    worker_id: str
    created_at: AwareDatetime
    finished_at: AwareDatetime = Field(default_factory=utcnow)


class DeadLetter(Message):
    """A message that could not be served, kept on ``llm.dlq`` for inspection and replay."""

    schema_version: Literal[1] = SCHEMA_VERSION
    reason: str = Field(min_length=1, description="Machine-readable cause, also in the 'reason' header.")
    detail: str = ""
    source_topic: str
    source_partition: int | None = None
    source_offset: int | None = None
    payload: str = Field(description="The original message value, decoded as UTF-8 with replacement.")
    payload_truncated: bool = Field(
        False, description="The payload was cut so the letter fits in one Kafka record; it cannot be replayed."
    )
    request_id: str | None = None
    failed_at: AwareDatetime = Field(default_factory=utcnow)


RequestStatus = Literal["queued", "running", "finished", "cancelled", "failed"]


class RequestRecord(Message):
    """A request's status as kept in Redis under ``Names.request_key`` (JSON), for ``GET /v1/requests/{id}``.

    Ingress writes it ``queued`` when it accepts the request; the owning worker moves it on.
    """

    request_id: RequestId
    model: str
    tenant: str
    priority: str
    status: RequestStatus
    created_at: AwareDatetime
    updated_at: AwareDatetime = Field(default_factory=utcnow)
    worker_id: str | None = None
    result: FinalResult | None = None
    # The request's trace context, so a relay connecting later (no Kafka header to read) joins its trace.
    trace: TraceContext | None = None
