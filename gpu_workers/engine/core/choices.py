"""``n > 1``: the sibling choices of a request, forked from its first choice once the prompt is computed.

The first choice prefills the prompt alone. In the step where its prompt's last token is computed, before
sampling, each sibling is forked: it shares the prompt's full KV blocks by reference and gets a copy of the
partial last block (copy-on-write), so the prompt is prefilled once. Each sibling then samples its first
token from the same logits row, with its own random draws (keyed by ``seed + index`` when a seed is given). When the
KV pool has no block for the copy, or the running set is full, the sibling waits like a preempted sequence
and is recomputed later (its full prompt blocks come back from the prefix cache).
"""

from __future__ import annotations

from collections.abc import Callable

from .block_manager import KVBlockManager
from .scheduler import Scheduler
from .sequence import Sequence


def fork_choices(
    parent: Sequence,
    make_sibling: Callable[[Sequence, int], Sequence],
    block_manager: KVBlockManager,
    scheduler: Scheduler,
    copy_block: Callable[[int, int], None],
) -> tuple[list[Sequence], list[Sequence]]:
    """Fork ``parent``'s pending siblings; returns (those that run now and sample in this step, those queued)."""
    running_now: list[Sequence] = []
    queued: list[Sequence] = []
    first_index = parent.index + 1
    for index in range(first_index, first_index + parent.num_pending_forks):
        child = make_sibling(parent, index)
        seated = len(scheduler.running) < scheduler.max_num_seqs
        if seated and block_manager.blocks_to_fork(parent) <= block_manager.num_free_blocks:
            pair = block_manager.fork(parent, child)
            if pair is not None:
                copy_block(*pair)
            scheduler.add_fork(child, running=True)
            running_now.append(child)
        else:
            scheduler.add_fork(child, running=False)
            queued.append(child)
    parent.num_pending_forks = 0
    return running_now, queued
