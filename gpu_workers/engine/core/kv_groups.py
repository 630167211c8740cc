"""Hybrid KV cache: one block table per layer group for models that mix full-attention and sliding-window
layers (Gemma 3), so the sliding layers keep only the blocks inside their window.

Layers are grouped by attention kind (``kv_group_layout``): group 0 holds the full-attention layers, group 1
the layers sliding by one window ``W``. Each group has its own pool of blocks (its own KV tensors, sized for
its layers, in the model runner) and its own ``KVBlockManager``; a sequence's group-0 table is
``seq.block_ids`` as for every other model, its group-1 table lives on a ``KVGroupView`` in
``seq.kv_group_views``. The sliding group gives back blocks behind the window (``NULL_BLOCK`` placeholders);
the full group keeps all.

Pool split (``split_kv_pool``): vLLM shares one pool of equal-sized pages between groups; here the two groups'
layer counts differ (Gemma 3: five sliding per full one), so the byte budget is split instead. The sliding
group gets what its running sequences can ever hold at once (each at most its window plus the step's new
tokens, one block of slack at either end), never more than the all-global count; the rest goes to the full
group, which therefore always holds at least as many blocks as an all-global cache would.

Prefix caching: each group caches its blocks under the same content hashes. A hit needs the whole prefix in
the full group and, in the sliding group, only the blocks inside the window of the hit's end (the first
position the next query still sees is ``hit_end - W + 1``); when some were released and evicted the hit is
shortened to the longest prefix that is whole in both groups. The KV events journal is the full group's: it
is what the fleet router indexes (a sliding-group eviction can only shorten a hit the router predicted).

Not built for hybrid models: copy-on-write forks (``blocks_to_fork`` says a fork never fits, so ``n > 1``
siblings recompute their prompt through the prefix cache), cascade attention and decode CUDA graphs (the
model runner turns both off).
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import NULL_BLOCK, KVBlockManager
from .sequence import KVGroupView, Sequence

FULL_GROUP, SLIDING_GROUP = 0, 1


@dataclass(frozen=True)
class KVGroupLayout:
    """Which attention layers form each KV group: ``layer_groups[i]`` is layer ``i``'s group, ``window`` the
    sliding group's window."""

    layer_groups: tuple[int, ...]
    window: int

    def layers_of(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self.layer_groups) if g == group]


def kv_group_layout(windows: list[int | None]) -> KVGroupLayout | None:
    """The hybrid layout of a model whose layers are full attention and one sliding window, else None (one
    group: all full, all sliding by one window, or several windows, which run as one full group)."""
    slides = {w for w in windows if w is not None}
    if len(slides) != 1 or None not in windows:
        return None
    return KVGroupLayout(tuple(FULL_GROUP if w is None else SLIDING_GROUP for w in windows), next(iter(slides)))


def split_kv_pool(
    all_global_blocks: int,
    layout: KVGroupLayout,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[int, int]:
    """(full group blocks, sliding group blocks) for the bytes ``all_global_blocks`` blocks of every layer take."""
    full_layers = len(layout.layers_of(FULL_GROUP))
    sliding_layers = len(layout.layers_of(SLIDING_GROUP))
    blocks = lambda n: -(-n // block_size)  # noqa: E731
    sliding_need = max_num_seqs * (blocks(layout.window) + 2) + blocks(max_num_batched_tokens)
    sliding = max(1, min(sliding_need, all_global_blocks))
    layer_blocks = all_global_blocks * (full_layers + sliding_layers)
    full = (layer_blocks - sliding * sliding_layers) // full_layers
    return full, sliding


def sliding_view(seq: Sequence) -> KVGroupView:
    """The sequence's sliding-group view, made on first use."""
    if not seq.kv_group_views:
        seq.kv_group_views.append(KVGroupView(seq))
    return seq.kv_group_views[0]


class HybridKVBlockManager:
    """``KVBlockManager``'s interface over a full group (``full``, tables in ``seq.block_ids``) and a sliding
    group (``sliding``, tables in ``seq.kv_group_views[0]``). Every operation is all or nothing across groups.
    Totals and free counts (``num_blocks``, ``num_free_blocks``) and the prefix hit counters are the full
    group's; ``group_blocks_in_use`` gives both."""

    def __init__(
        self, full_blocks: int, sliding_blocks: int, block_size: int, enable_prefix_caching: bool, window: int
    ) -> None:
        self.full = KVBlockManager(full_blocks, block_size, enable_prefix_caching)
        self.sliding = KVBlockManager(sliding_blocks, block_size, enable_prefix_caching, sliding_window=window)
        self.block_size = block_size
        self.window = window
        # Hybrid releases per group; the scheduler's all-sliding attribute stays None.
        self.sliding_window = None

    # ------------------------------------------------------------------ shared interface
    @property
    def groups(self) -> tuple[KVBlockManager, KVBlockManager]:
        """Every group's manager, group 0 first."""
        return self.full, self.sliding

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.full.num_cached_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.full.prefix_hit_rate

    @property
    def prefix_query_tokens(self) -> int:
        return self.full.prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.full.prefix_hit_tokens

    @property
    def enable_prefix_caching(self) -> bool:
        return self.full.enable_prefix_caching

    @enable_prefix_caching.setter
    def enable_prefix_caching(self, value: bool) -> None:
        self.full.enable_prefix_caching = self.sliding.enable_prefix_caching = value

    @property
    def record_kv_events(self) -> bool:
        return self.full.record_kv_events

    @record_kv_events.setter
    def record_kv_events(self, value: bool) -> None:
        self.full.record_kv_events = value

    def group_blocks_in_use(self) -> tuple[int, int]:
        """(full, sliding) blocks that sequences hold now (those not in either group's free queue)."""
        return (
            self.full.num_blocks - self.full.num_free_blocks,
            self.sliding.num_blocks - self.sliding.num_free_blocks,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return self.full.blocks_for(num_tokens)

    def take_kv_events(self) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
        return self.full.take_kv_events()

    def cached_hashes(self) -> list[bytes]:
        return self.full.cached_hashes()

    # ------------------------------------------------------------------ prefix cache
    def _first_in_window(self, num_blocks: int) -> int:
        """First block the next query reads in the sliding group after a hit of ``num_blocks`` blocks."""
        return max(num_blocks * self.block_size - self.window + 1, 0) // self.block_size

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """The full group's hits, shortened to the longest prefix whose in-window blocks the sliding group
        still caches too."""
        hits = self.full.lookup_prefix(seq)
        num = len(hits)
        while num > 0:
            first = self._first_in_window(num)
            missing = [i for i in range(first, num) if self.sliding.cached_block(seq.block_hashes[i]) is None]
            if not missing:
                break
            num = missing[-1]  # any hit reaching past a missing in-window block would read it
        return hits[:num]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        self.full.cache_computed_blocks(seq)
        self.sliding.cache_computed_blocks(sliding_view(seq))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ allocation
    def _sliding_hits(self, seq: Sequence, num_hits: int) -> list[int]:
        first = self._first_in_window(num_hits)
        hits = [NULL_BLOCK] * first
        for h in seq.block_hashes[first:num_hits]:
            block_id = self.sliding.cached_block(h)
            if block_id is None:
                raise RuntimeError("a prefix hit lost its sliding-group block between lookup and allocation")
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        view = sliding_view(seq)
        sliding_hits = self._sliding_hits(seq, len(hits))
        if not (self.full.fits(hits, num_new_tokens) and self.sliding.fits(sliding_hits, num_new_tokens)):
            return False
        self.full.allocate(seq, hits, num_new_tokens)
        self.sliding.allocate(view, sliding_hits, num_new_tokens)  # type: ignore[arg-type]
        return True

    def release_out_of_window(self, seq: Sequence) -> int:
        return self.sliding.release_out_of_window(sliding_view(seq))  # type: ignore[arg-type]

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        view = sliding_view(seq)
        end = seq.num_computed_tokens + num_new_tokens
        full_need = self.full.blocks_for(end) - len(seq.block_ids)
        sliding_need = self.sliding.blocks_for(end) - len(view.block_ids)
        if full_need > self.full.num_free_blocks or sliding_need > self.sliding.num_free_blocks:
            return False
        self.full.append_slots(seq, num_new_tokens)
        self.sliding.append_slots(view, num_new_tokens)  # type: ignore[arg-type]
        return True

    def blocks_to_fork(self, parent: Sequence) -> int:
        """More than ever free: hybrid forks recompute through the prefix cache (no per-group copy-on-write)."""
        return self.full.num_blocks + 1

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        raise RuntimeError("hybrid KV groups do not fork; blocks_to_fork never fits")

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        if seq.kv_group_views:
            self.sliding.free(seq.kv_group_views[0])  # type: ignore[arg-type]
