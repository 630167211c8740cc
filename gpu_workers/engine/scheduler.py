"""Token-level scheduler: picks which sequences run each step and how many tokens each computes.

Every step has a token budget (``max_num_batched_tokens``). Running sequences in decode go first,
then running sequences with prefill left (chunked), then waiting requests, each group in priority
order (tier, then arrival). When the KV pool runs dry the least important running sequence is
preempted: its blocks are freed and it returns to the waiting queue to be recomputed later from
prompt + generated tokens. A waiting request may preempt running ones of a lower tier.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .block_manager import KVBlockManager
from .sequence import RequestStatus, Sequence


@dataclass
class ScheduledBatch:
    """The work of one step: sequence ``seqs[i]`` computes its next ``num_new_tokens[i]`` tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Holds the waiting and running queues (both kept sorted by ``Sequence.sort_key``)."""

    def __init__(
        self,
        block_manager: KVBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunked_prefill_steps = 0

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Mark a sequence finished and give its blocks back (its full blocks stay cached)."""
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch:
        step = _StepState(budget=self.max_num_batched_tokens)
        self._schedule_running(step, decode_phase=True)
        self._schedule_running(step, decode_phase=False)
        self._schedule_waiting(step)
        batch = ScheduledBatch(preempted=step.preempted)
        for seq, n in step.scheduled.items():
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            if seq.num_computed_tokens + n < seq.num_tokens:
                self.num_chunked_prefill_steps += 1
        return batch

    def _schedule_running(self, step: _StepState, decode_phase: bool) -> None:
        idx = 0
        while idx < len(self.running) and step.budget > 0:
            seq = self.running[idx]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if seq in step.scheduled or (remaining == 1) != decode_phase:
                idx += 1
                continue
            num_new = min(remaining, step.budget)
            while not self.block_manager.append_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                step.scheduled[seq] = num_new
                step.budget -= num_new
                idx += 1
                continue
            # ``seq`` preempted itself: it was the least important running sequence, so every
            # sequence after it is gone too.
            return

    def _schedule_waiting(self, step: _StepState) -> None:
        bm = self.block_manager
        while self.waiting and step.budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_lower_tier(seq, step):
                    return
                continue
            hits = bm.lookup_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * bm.block_size, step.budget)
            if not bm.allocate(seq, hits, num_new):
                if not self._preempt_lower_tier(seq, step):
                    return
                continue
            self.waiting.pop(0)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = RequestStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            step.scheduled[seq] = num_new
            step.budget -= num_new

    def _preempt_lower_tier(self, seq: Sequence, step: _StepState) -> bool:
        """Preempt the least important running sequence of a lower tier than ``seq``, if any."""
        if not self.running or self.running[-1].priority <= seq.priority:
            return False
        self._preempt(self.running[-1], step)
        return True

    def _preempt(self, victim: Sequence, step: _StepState) -> None:
        self.running.remove(victim)
        if victim in step.scheduled:
            step.budget += step.scheduled.pop(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(victim)
        self.add(victim)


@dataclass
class _StepState:
    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)


def _sort_key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key
