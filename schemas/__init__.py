"""Pydantic v2 message contracts shared by every Sluicegate service and outside producer.

Topic and Redis key names live in :mod:`schemas.names`; nothing else spells them.
"""

from .common import SCHEMA_VERSION, utcnow
from .control import (
    CancelRequest,
    DeadLetter,
    FinalResult,
    PartitionRef,
    RequestRecord,
    RequestStatus,
    WorkerHeartbeat,
)
from .events import (
    STREAM_FIELD,
    TERMINAL_TYPES,
    DoneEvent,
    ErrorEvent,
    FinishReason,
    RestartEvent,
    StreamEvent,
    TokenEvent,
    Usage,
    parse_stream_event,
    seq_from_entry_id,
    stream_entry_id,
    stream_event_adapter,
)
from .names import TIERS, Names, Tier, model_token, tier_rank
from .requests import ChatMessage, InferenceRequest, SamplingOptions, TextPart, TraceContext

__all__ = [
    "SCHEMA_VERSION",
    "STREAM_FIELD",
    "TERMINAL_TYPES",
    "TIERS",
    "CancelRequest",
    "ChatMessage",
    "DeadLetter",
    "DoneEvent",
    "ErrorEvent",
    "FinalResult",
    "FinishReason",
    "InferenceRequest",
    "Names",
    "PartitionRef",
    "RequestRecord",
    "RequestStatus",
    "RestartEvent",
    "SamplingOptions",
    "StreamEvent",
    "TextPart",
    "Tier",
    "TokenEvent",
    "TraceContext",
    "Usage",
    "WorkerHeartbeat",
    "model_token",
    "parse_stream_event",
    "seq_from_entry_id",
    "stream_entry_id",
    "stream_event_adapter",
    "tier_rank",
    "utcnow",
]
