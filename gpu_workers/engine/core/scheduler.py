"""Token-level scheduler: picks which sequences run each step and how many tokens each computes.

A tier is one integer priority, lower numbers first; the tiers are those of the unfinished sequences.
Every step has a token budget (``max_num_batched_tokens``). Running sequences in decode go first,
then prefill work tier by tier: a tier's running sequences with prefill left (chunked), then its
waiting requests. Lower-tier chunked prefills therefore never take the budget a waiting higher-tier
request needs. With an all-sliding-window model a running sequence first gives back the blocks its window left
behind (``KVBlockManager.release_out_of_window``). When the KV pool runs dry the least important running sequence
(lowest tier; in it, one without a deadline before the latest deadline, then latest arrival) is preempted: its
blocks are freed and it returns to the waiting queue to be recomputed later from prompt + generated tokens. A
waiting request may preempt running ones of a lower tier.

Inside a tier, waiting requests are admitted by tenant fair queuing: each tenant with unfinished
requests has a virtual time, advanced by the tokens scheduled for it divided by its weight, and the
next admission goes to the tenant with the smallest one (its earliest request). A tenant that joins
starts at the smallest virtual time among the others, so idling earns no credit. A tenant flooding a
tier thus cannot hold back another tenant of that tier beyond the sequences already running.

While the most important tier has unfinished work (running or waiting), the less important tiers together
compute at most ``lower_tier_max_batched_tokens`` tokens a step (their decode seats and prefill chunks alike),
so the step an interactive request waits behind stays short; with only one tier left they get the whole budget.

Inside a tier, waiting requests with a deadline come first, earliest deadline first (EDF: they sort ahead of the
others by ``Sequence.sort_key``), and tenant fair queuing orders only those without one. EDF is about which
waiting request starts next; a running sequence is never preempted for a deadline of its own tier.

A sequence with a LoRA adapter is admitted only once its adapter holds a device slot (``LoRAAdmission``): when
every slot is pinned by running sequences of other adapters it is passed over for this step (as vLLM does) and
the next waiting sequence is considered, so base-model requests and those of resident adapters are not held
behind it. The adapter stays pinned while the sequence runs (released when it finishes or is preempted).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

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


class LoRAAdmission(Protocol):
    """The adapters' side of scheduling (``lora.manager.LoRAManager``), told about sequences with an adapter."""

    def on_add(self, seq: Sequence) -> None: ...

    def on_finish(self, seq: Sequence) -> None: ...

    def acquire(self, seq: Sequence) -> bool: ...

    def release(self, seq: Sequence) -> None: ...


class Scheduler:
    """Holds the waiting and running queues (both kept sorted by ``Sequence.sort_key``)."""

    def __init__(
        self,
        block_manager: KVBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        tenant_weights: Mapping[str, float] | None = None,
        lower_tier_max_batched_tokens: int | None = None,
        lora: LoRAAdmission | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tenant_weights: dict[str, float] = dict(tenant_weights or {})
        # None: no cap. Otherwise the lower tiers' token share of a step while a more important tier has work.
        self.lower_tier_max_batched_tokens = lower_tier_max_batched_tokens
        # Tenants with unfinished sequences only, so the map is as small as the live tenant set.
        self.tenants: dict[str, TenantShare] = {}
        # Unfinished sequences per priority: the tiers a step works through, lowest number first.
        self.tiers: dict[int, int] = {}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunked_prefill_steps = 0

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence and count it in its tenant's share."""
        share = self.tenants.get(seq.tenant)
        if share is None:
            # No credit for idle time, no debt for what others were served meanwhile.
            start = min((t.vtime for t in self.tenants.values()), default=0.0)
            share = self.tenants[seq.tenant] = TenantShare(self.tenant_weights.get(seq.tenant, 1.0), start)
        share.num_unfinished += 1
        self.tiers[seq.priority] = self.tiers.get(seq.priority, 0) + 1
        if seq.lora_request is not None:
            self._lora.on_add(seq)
        self._enqueue(seq)

    @property
    def _lora(self) -> LoRAAdmission:
        if self.lora is None:
            raise RuntimeError("a sequence names a LoRA adapter, but the scheduler has no LoRA admission")
        return self.lora

    def add_fork(self, seq: Sequence, running: bool) -> None:
        """Count a sibling choice forked from a running sequence: straight into ``running`` when it got its
        blocks (and a seat), else into the waiting queue to be recomputed from the prefix cache."""
        self.add(seq)
        if running:
            # The parent runs with the same adapter, so its slot is pinned already and this cannot fail.
            if seq.lora_request is not None and not self._lora.acquire(seq):
                raise RuntimeError("a forked choice found no slot for its parent's LoRA adapter")
            self.waiting.remove(seq)
            seq.status = RequestStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def counts_by_priority(self) -> tuple[dict[int, int], dict[int, int]]:
        """Running and waiting sequences per priority, without walking either queue (the stats are taken every
        step): the running batch is sorted by priority, so two bisections count a priority's run of it, and
        the waiting count is the unfinished count per priority, kept as sequences come and go, less that."""
        running: dict[int, int] = {}
        for priority in self.tiers:
            lo = bisect.bisect_left(self.running, (priority,), key=_sort_key)
            hi = bisect.bisect_left(self.running, (priority + 1,), key=_sort_key)
            if hi > lo:
                running[priority] = hi - lo
        waiting = {p: n - running.get(p, 0) for p, n in self.tiers.items() if n > running.get(p, 0)}
        return running, waiting

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Mark a sequence finished and give its blocks back (its full blocks stay cached)."""
        if seq.status is RequestStatus.RUNNING or seq.status is RequestStatus.WAITING:
            (self.running if seq.status is RequestStatus.RUNNING else self.waiting).remove(seq)
            if seq.lora_request is not None:
                if seq.status is RequestStatus.RUNNING:
                    self._lora.release(seq)
                self._lora.on_finish(seq)
            share = self.tenants[seq.tenant]
            share.num_unfinished -= 1
            if share.num_unfinished == 0:
                del self.tenants[seq.tenant]
            self.tiers[seq.priority] -= 1
            if self.tiers[seq.priority] == 0:
                del self.tiers[seq.priority]
        self.block_manager.free(seq)
        seq.status = status

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch:
        step = _StepState(budget=self.max_num_batched_tokens)
        if self.lower_tier_max_batched_tokens is not None and len(self.tiers) > 1:
            step.top_tier = min(self.tiers)
            step.lower_budget = self.lower_tier_max_batched_tokens
        self._schedule_running(step, decode_phase=True)
        admitting = True
        for tier in sorted(self.tiers):
            self._schedule_running(step, decode_phase=False, tier=tier)
            # A blocked admission holds back lower tiers too: they would take the room it waits for.
            admitting = admitting and self._schedule_waiting(step, tier)
        batch = ScheduledBatch(preempted=step.preempted)
        for seq, n in step.scheduled.items():
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            if seq.num_computed_tokens + n < seq.num_tokens:
                self.num_chunked_prefill_steps += 1
        return batch

    def _schedule_running(self, step: _StepState, decode_phase: bool, tier: int | None = None) -> None:
        """Schedule running sequences in decode (or with prefill left), all of them or those of ``tier``."""
        idx = 0 if tier is None else bisect.bisect_left(self.running, (tier,), key=_sort_key)
        while idx < len(self.running) and step.budget > 0:
            seq = self.running[idx]
            if tier is not None and seq.priority != tier:
                return  # ``running`` is sorted by tier: the rest belong to lower tiers
            remaining = seq.num_tokens - seq.num_computed_tokens
            if seq in step.scheduled or (remaining == 1) != decode_phase:
                idx += 1
                continue
            # A decode with drafts computes them too (verification); a tight budget drops the tail drafts.
            num_new = min(remaining + len(seq.spec_token_ids), step.room_for(seq))
            if num_new <= 0:
                idx += 1  # a lower tier whose share of this step is spent: it waits, keeping its blocks
                continue
            # Blocks behind a sliding window go back before this one asks for more.
            self.block_manager.release_out_of_window(seq)
            while not self.block_manager.append_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                if seq.spec_token_ids:
                    del seq.spec_token_ids[num_new - 1 :]
                step.take(seq, num_new)
                self._charge(seq, num_new)
                idx += 1
                continue
            # ``seq`` preempted itself: it was the least important running sequence, so every
            # sequence after it is gone too.
            return

    def _schedule_waiting(self, step: _StepState, tier: int) -> bool:
        """Admit waiting sequences of ``tier`` while budget, seats and blocks allow; False when the next
        one is blocked or the budget ran out (nothing of a lower tier may be admitted then)."""
        bm = self.block_manager
        while step.budget > 0:
            idx = self._pick_waiting(tier, step.no_lora_slot)
            if idx is None:
                return True
            seq = self.waiting[idx]
            if step.room_for(seq) <= 0:
                return False  # the lower tiers' share of this step is spent
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_lower_tier(seq, step):
                    return False
                continue
            if seq.lora_request is not None and not self._lora.acquire(seq):
                # Every adapter slot is pinned by running sequences of other adapters: it waits for one to finish.
                step.no_lora_slot.add(seq)
                continue
            hits = bm.lookup_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * bm.block_size, step.room_for(seq))
            if not bm.allocate(seq, hits, num_new):
                if seq.lora_request is not None:
                    self._lora.release(seq)
                if not self._preempt_lower_tier(seq, step):
                    return False
                continue
            self.waiting.pop(idx)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = RequestStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            step.take(seq, num_new)
            self._charge(seq, num_new)
        return False

    def _pick_waiting(self, tier: int, skip: set[Sequence] | None = None) -> int | None:
        """Index in ``waiting`` of the next ``tier`` sequence to admit: the one with the earliest deadline, else
        the earliest one of the tenant with the smallest virtual time (ties go to the earliest arrival); None
        when the tier has nothing waiting. Sequences in ``skip`` (no adapter slot this step) are passed over."""
        waiting = self.waiting
        start = bisect.bisect_left(waiting, (tier,), key=_sort_key)
        while skip and start < len(waiting) and waiting[start] in skip:
            start += 1
        if start == len(waiting) or waiting[start].priority != tier:
            return None
        if len(self.tenants) == 1 or waiting[start].deadline is not None:
            return start  # sorted by deadline within the tier: the first one has the earliest
        best, best_vtime = start, self.tenants[waiting[start].tenant].vtime
        seen = {waiting[start].tenant}
        for idx in range(start + 1, len(waiting)):
            seq = waiting[idx]
            if seq.priority != tier or len(seen) == len(self.tenants):
                break
            if seq.tenant not in seen and not (skip and seq in skip):
                seen.add(seq.tenant)
                vtime = self.tenants[seq.tenant].vtime
                if vtime < best_vtime:
                    best, best_vtime = idx, vtime
        return best

    def _charge(self, seq: Sequence, num_tokens: int) -> None:
        """Advance the tenant's virtual time by ``num_tokens`` scheduled (negative: taken back)."""
        # Only differences between tenants matter, and a joining tenant starts at the others' minimum,
        # so with a single tenant there is nothing to keep.
        if len(self.tenants) > 1:
            share = self.tenants[seq.tenant]
            share.vtime += num_tokens / share.weight

    def _preempt_lower_tier(self, seq: Sequence, step: _StepState) -> bool:
        """Preempt the least important running sequence of a lower tier than ``seq``, if any."""
        if not self.running or self.running[-1].priority <= seq.priority:
            return False
        self._preempt(self.running[-1], step)
        return True

    def _preempt(self, victim: Sequence, step: _StepState) -> None:
        self.running.remove(victim)
        if victim.lora_request is not None:
            self._lora.release(victim)
        if victim in step.scheduled:
            taken_back = step.give_back(victim)
            self._charge(victim, -taken_back)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids.clear()
        victim.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(victim)
        self._enqueue(victim)


@dataclass
class TenantShare:
    """Fair-queuing state of a tenant with unfinished sequences."""

    weight: float
    # Tokens scheduled for the tenant divided by its weight, on the clock shared by the live tenants.
    vtime: float
    num_unfinished: int = 0


@dataclass
class _StepState:
    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    # Set while a more important tier has work: that tier, and what the tiers below it may still take.
    top_tier: int | None = None
    lower_budget: int = 0
    # Waiting sequences whose adapter found no free device slot this step.
    no_lora_slot: set[Sequence] = field(default_factory=set)

    def room_for(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still be given this step."""
        if self.top_tier is not None and seq.priority > self.top_tier:
            return min(self.budget, self.lower_budget)
        return self.budget

    def take(self, seq: Sequence, num_tokens: int) -> None:
        self.scheduled[seq] = num_tokens
        self.budget -= num_tokens
        if self.top_tier is not None and seq.priority > self.top_tier:
            self.lower_budget -= num_tokens

    def give_back(self, seq: Sequence) -> int:
        num_tokens = self.scheduled.pop(seq)
        self.budget += num_tokens
        if self.top_tier is not None and seq.priority > self.top_tier:
            self.lower_budget += num_tokens
        return num_tokens


def _sort_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.sort_key
