"""What the engine hands back: finished results, per-step stream deltas, and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_offload import OffloadStats


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) and cache facts of one request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    # Prompt tokens served from the prefix cache when the request was first scheduled.
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """A finished request. ``token_ids`` are the generated tokens (EOS / stop id included when one
    ended the request); ``text`` is their decoded text, cut before a matched stop string."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None
    metrics: RequestMetrics
    # The choice (n > 1) and, when asked for, one ``TokenLogprob`` per entry of ``token_ids``.
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    # ``LLM.generate`` only: every choice of the request, by index (this one first).
    choices: list[RequestOutput] = field(default_factory=list, repr=False)
    # An embedding request's L2-normalized pooled vector (it generates no tokens).
    embedding: list[float] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


@dataclass
class TokenLogprob:
    """One generated token's logprob and the ``top`` alternatives as (token id, logprob), best first,
    from the log-softmax of the model's raw logits."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestDelta:
    """What one request gained in one engine step (the unit the async API streams).

    ``text`` and ``token_ids`` are increments; joined over the stream they give the final output.
    Text that might be the start of a stop string is held back until it is known not to be one.
    ``final`` carries the full ``RequestOutput`` on the last delta.
    ``index`` is the choice (for ``n > 1``: each choice ends on its own finished delta, and the
    request's stream ends after all ``n``); ``logprobs`` is aligned with ``token_ids`` when asked for.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    final: RequestOutput | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    # An embedding request's one (finished) delta carries its L2-normalized pooled vector.
    embedding: list[float] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class KVCacheEvents:
    """What the prefix cache did over one step, or (``snapshot``) all it holds now, by block hash
    (``sluicegate.block_hashes``): ``stored`` the blocks newly cached with their parent hashes (the chain seed for
    a first block; empty in a snapshot, which replaces what was known), ``removed`` the ones evicted. Apply stored
    before removed: a block may be cached and evicted within one step.

    ``tier`` is where the blocks sit: ``pool`` for the prefix cache itself; the pool's events carry, in ``tiers``,
    the same step's (or snapshot's) events of the offload tiers (``host``, ``disk``, ``shared``)."""

    block_size: int
    stored: list[tuple[bytes, bytes]] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    snapshot: bool = False
    tier: str = "pool"
    tiers: list[KVCacheEvents] = field(default_factory=list)


@dataclass
class EngineStats:
    """A snapshot for heartbeats and dashboards."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # The two counts above split by request priority (the scheduling tier, lower first); priorities with
    # none are absent. What a priority means to the caller is the caller's business.
    running_by_priority: dict[int, int] = field(default_factory=dict)
    waiting_by_priority: dict[int, int] = field(default_factory=dict)
    # Speculative decoding, cumulative: verification steps (one per sequence that had drafts), drafts proposed,
    # drafts accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The offload tiers' counters (hits and bytes per tier, load time), when the engine has tiers.
    kv_offload: OffloadStats | None = None

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of draft tokens the target accepted (0 before any draft)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the target's own token (1 = no gain)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_cache_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks
