"""Request state as the engine tracks it: tokens, progress through the KV cache, status and timings."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..detokenizer import IncrementalDetokenizer
    from ..guided.matcher import GuidedState
    from ..lora.request import LoRARequest
    from ..outputs import TokenLogprob
    from .counter_rng import SeededStream


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Sequence:
    """One request. ``token_ids`` is prompt + generated tokens; the first ``num_computed_tokens``
    of them have K/V in the blocks listed in ``block_ids``. A preempted sequence drops its blocks
    and recomputes ``token_ids`` (prompt and generated alike) when it is scheduled again."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # Scheduling tier: lower runs first.
    priority: int
    arrival_time: float
    arrival_index: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    # A seeded choice's keyed random draws (core/counter_rng.py); None: the engine's generator.
    rng: SeededStream | None = None
    # Who the request is for: sequences of one tier share the engine fairly between tenants.
    tenant: str = "default"
    # ``time.time()`` seconds: inside its tier the sequence goes earliest-deadline-first, before those without one.
    deadline: float | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained content hashes of full blocks of ``token_ids``, kept across preemption.
    block_hashes: list[bytes] = field(default_factory=list)
    # How many leading entries of ``block_ids`` are registered in the prefix cache.
    num_registered_blocks: int = 0
    # A hybrid KV cache's block tables past the first group (``core/kv_groups.py``); empty otherwise.
    kv_group_views: list[KVGroupView] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    text: str = ""
    # Characters of ``text`` already handed out as stream deltas.
    num_text_sent: int = 0
    # Tokens already handed out as stream deltas.
    num_tokens_sent: int = 0
    # ``time.time()`` of the step that last handed out a delta (``EngineConfig.stream_interval_ms`` counts from it).
    last_delta_time: float | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # The choice this sequence is (n > 1: siblings share request_id and differ by index).
    index: int = 0
    # Choices still to fork from this one once its prompt is computed (n - 1 on the first choice).
    num_pending_forks: int = 0
    # One entry per generated token when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # The grammar matcher of a guided request.
    guided: GuidedState | None = None
    # Draft tokens (speculative decoding) to verify after the last token this step; never part of token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    # Embedding requests: the pooling method ("last" or "mean"; None generates), the float32 sum of the hidden
    # states pooled so far (mean, across prefill chunks) and, once the prompt is computed, the L2-normalized vector.
    pooling: str | None = None
    pool_sum: torch.Tensor | None = None
    embedding: list[float] | None = None
    # The LoRA adapter the sequence decodes with (None: the base model); its id seeds the prefix cache's hashes.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: tier first, then deadline (earliest first, none last), then arrival."""
        return (self.priority, math.inf if self.deadline is None else self.deadline, self.arrival_index)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)


class KVGroupView:
    """A sequence as one more KV layer group's ``KVBlockManager`` sees it (``core/kv_groups.py``): its own block
    table and registration count, everything else (tokens, hashes, progress) read through to the sequence."""

    __slots__ = ("block_ids", "num_registered_blocks", "seq")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.block_ids: list[int] = []
        self.num_registered_blocks = 0

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.seq.num_computed_tokens = value

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def block_hashes(self) -> list[bytes]:
        return self.seq.block_hashes

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.seq.max_tokens

    @property
    def lora_int_id(self) -> int:
        return self.seq.lora_int_id

    @property
    def pooling(self) -> str | None:
        return self.seq.pooling

    @property
    def request_id(self) -> str:
        return self.seq.request_id
