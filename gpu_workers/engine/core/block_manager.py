"""Paged KV-cache block accounting: ref-counted blocks, prefix caching by chained block hashes,
least-recently-used eviction of free cached blocks, prefix hit counters, the release of blocks that fell
out of a sliding attention window, and the two hooks of the offload tiers (``KVTierHook``): a block that fills is
handed to them, and a prefix lookup that ends in the pool asks them for the blocks that follow.

Sliding window: when every attention layer of the model sees only the last ``sliding_window`` positions, a
block whose positions all lie before ``next_position - sliding_window + 1`` is never read again, so
``release_out_of_window`` drops the sequence's reference and leaves ``NULL_BLOCK`` in its place in
``seq.block_ids`` (the list stays indexed by position; backends never read entries outside the window). A
released block keeps its hash and stays findable in the prefix cache until evicted: prefix lookups walk the
hash chain from the first block and stop at the first one no longer cached, so a hit is always a whole prefix
whose K/V is all present, never one with early blocks missing. Models that mix sliding and full-attention
layers (Gemma 3) run one manager per layer group (``kv_groups.HybridKVBlockManager``): the full group's with
``sliding_window=None``, the sliding group's with the window."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from typing import Protocol

# The hash chain lives in the runtime library, where the router hashes prompts the same way; a pure module, the
# engine's one import from outside itself.
from sluicegate.block_hashes import chain_seed, hash_block

from .sequence import Sequence

# Stands in ``seq.block_ids`` for a block released because it fell out of the sliding window.
NULL_BLOCK = -1

# How far the placement cursor looks for a fresh block before falling back to the LRU queue.
_PLACEMENT_PROBES = 64


class KVTierHook(Protocol):
    """The offload tiers as the block manager sees them (``kv_offload.KVOffloader``)."""

    def block_filled(self, block_hash: bytes, parent: bytes, block_id: int) -> None: ...

    def fetch_prefix(self, block_hashes: SequenceABC[bytes]) -> SequenceABC[object]: ...

    def load_block(self, block_id: int, block: object) -> None: ...


class KVBlockManager:
    """Owns every KV block id and decides which sequence holds which blocks.

    A block is *free* when no sequence references it. Free blocks queue in ``_free`` from least to
    most recently released. A free block that still carries a hash stays findable in ``_cached``
    until it is handed out again (evicted), so a later request with the same prefix can pick it
    back up; eviction follows the queue order. Free blocks without cached content may be taken
    out of order to keep each sequence's blocks consecutive (see ``_next_block``).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        # Set only when every layer slides with this window: blocks behind it are released.
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._cursor = 0
        # The KV event journal (``take_kv_events``): off unless someone drains it, or it would grow forever.
        self.record_kv_events = False
        self._kv_stored: list[tuple[bytes, bytes]] = []
        self._kv_removed: list[bytes] = []
        # The offload tiers, when the engine has any (set by the engine once its KV cache exists).
        self.tier: KVTierHook | None = None

    # ------------------------------------------------------------------ introspection
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up tokens that came from the prefix cache."""
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else chain_seed(seq.lora_int_id)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks, without taking them.

        The hit never covers the last token, so the model always has at least one token to run
        and produces logits for the next one.
        """
        if not self.enable_prefix_caching or seq.pooling is not None:
            return []  # an embedding request computes its whole prompt itself
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits: list[int] = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.tier is not None and len(hits) < max_blocks:
            hits += self._load_from_tier(seq, hits, max_blocks)
        return hits

    def _load_from_tier(self, seq: Sequence, hits: list[int], max_blocks: int) -> list[int]:
        """Bring the blocks after the pool's hits in from the offload tiers, as cached free blocks (the caller
        takes them like any hit). Uses only blocks that are free beyond the hits; the hits and the blocks already
        loaded are held meanwhile so that taking a free block never evicts them."""
        room = len(self._free) - sum(1 for b in hits if self._ref_counts[b] == 0)
        wanted = seq.block_hashes[len(hits) : len(hits) + min(max_blocks - len(hits), room)]
        fetched = self.tier.fetch_prefix(wanted) if wanted and self.tier is not None else []
        if not fetched:
            return []
        for block_id in hits:
            self._take_cached(block_id)
        loaded: list[int] = []
        for i, block in enumerate(fetched):
            h = wanted[i]
            block_id = self._cached.get(h, -1)
            if block_id >= 0:  # still in the pool past the first miss
                self._take_cached(block_id)
            else:
                block_id = self._pop_free()
                self.tier.load_block(block_id, block)
                self._cached[h] = block_id
                self._block_hash[block_id] = h
                if self.record_kv_events:
                    parent = seq.block_hashes[len(hits) + i - 1] if hits or i else chain_seed(seq.lora_int_id)
                    self._kv_stored.append((h, parent))
            loaded.append(block_id)
        for block_id in reversed(hits + loaded):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
        return loaded

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are now full of computed K/V under their hashes."""
        if not self.enable_prefix_caching or seq.pooling is not None:
            return  # nor does it offer its blocks to others
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_ids[i]
            if block_id == NULL_BLOCK or self._block_hash[block_id] is not None:
                continue
            h = seq.block_hashes[i]
            # A block with the same content may already be cached (two requests prefilled the same
            # prefix at once); keep the first and let this one stay anonymous.
            if h not in self._cached:
                self._cached[h] = block_id
                self._block_hash[block_id] = h
                parent = seq.block_hashes[i - 1] if i else chain_seed(seq.lora_int_id)
                if self.record_kv_events:
                    self._kv_stored.append((h, parent))
                if self.tier is not None:
                    self.tier.block_filled(h, parent, block_id)
        seq.num_registered_blocks = num_full

    def take_kv_events(self) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
        """The blocks cached (each ``(hash, parent hash)``) and evicted since the last call, in order; empties the
        journal. A block both cached and evicted in between appears in both lists: apply stored, then removed."""
        stored, removed = self._kv_stored, self._kv_removed
        self._kv_stored, self._kv_removed = [], []
        return stored, removed

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block caching this content, or None (a lookup that takes nothing)."""
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now (a snapshot); the journal restarts from here."""
        self._kv_stored, self._kv_removed = [], []
        return list(self._cached)

    # ------------------------------------------------------------------ allocation
    def _take_cached(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        h = self._block_hash[block_id]
        if h is not None:
            # Evict: the block is about to be overwritten with other content.
            if self._cached.get(h) == block_id:
                del self._cached[h]
                if self.record_kv_events:
                    self._kv_removed.append(h)
            self._block_hash[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def _is_fresh(self, block_id: int) -> bool:
        """Free and holding no cached content, so taking it out of LRU order costs nothing."""
        return (
            0 <= block_id < self.num_blocks and self._ref_counts[block_id] == 0 and self._block_hash[block_id] is None
        )

    def _claim(self, block_id: int) -> int:
        del self._free[block_id]
        self._ref_counts[block_id] = 1
        return block_id

    def _next_block(self, seq: Sequence) -> int:
        """Pick the sequence's next block, keeping its blocks consecutive when that is free.

        Consecutive blocks let attention read a sequence's K/V in place instead of gathering it.
        Placement is best effort: the block right after the sequence's last one if fresh, else the
        start of a fresh stretch found from a roving cursor (which then skips past the room the
        whole request may grow into), else the least recently used free block.
        """
        if seq.block_ids and self._is_fresh(seq.block_ids[-1] + 1):
            return self._claim(seq.block_ids[-1] + 1)
        room = self.blocks_for(seq.num_prompt_tokens + seq.max_tokens) - len(seq.block_ids)
        candidate = self._cursor
        for _ in range(_PLACEMENT_PROBES):
            if candidate >= self.num_blocks:
                candidate = 0
            if self._is_fresh(candidate):
                self._cursor = candidate + max(room, 1)
                return self._claim(candidate)
            candidate += 1
        return self._pop_free()

    def fits(self, hits: list[int], num_new_tokens: int) -> bool:
        """Whether ``allocate`` with these hits and new tokens finds enough free blocks (it changes nothing)."""
        num_new_blocks = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        # Hit blocks that sit in the free queue stop being allocatable once we take them.
        free_hits = sum(1 for b in hits if b != NULL_BLOCK and self._ref_counts[b] == 0)
        return num_new_blocks <= len(self._free) - free_hits

    def allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Give a block-less sequence its prefix hits plus blocks for ``num_new_tokens`` more tokens.

        All or nothing: returns False and changes nothing when the free pool is too small. A hit may be
        ``NULL_BLOCK`` (a sliding group's block behind the window of the hit's end: never read, not held).
        """
        if seq.block_ids:
            raise RuntimeError(f"request {seq.request_id} already holds blocks")
        if not self.fits(hits, num_new_tokens):
            return False
        num_hit_tokens = len(hits) * self.block_size
        num_new_blocks = self.blocks_for(num_hit_tokens + num_new_tokens) - len(hits)
        for block_id in hits:
            if block_id != NULL_BLOCK:
                self._take_cached(block_id)
        seq.block_ids = list(hits)
        for _ in range(num_new_blocks):
            seq.block_ids.append(self._next_block(seq))
        seq.num_computed_tokens = num_hit_tokens
        seq.num_registered_blocks = len(hits)
        if self.enable_prefix_caching and seq.pooling is None:  # embeddings never look: no misses either
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += num_hit_tokens
        # A long prefix hit may reach back past the window: those blocks go back at once.
        self.release_out_of_window(seq)
        return True

    def release_out_of_window(self, seq: Sequence) -> int:
        """Release the blocks of ``seq`` that no future query can attend to (all-sliding models only):
        block ``b`` when ``(b + 1) * block_size <= num_computed_tokens - sliding_window + 1``, the first
        position the next query still sees. Returns how many blocks were released."""
        if self.sliding_window is None:
            return 0
        first_needed = seq.num_computed_tokens - self.sliding_window + 1
        num_dead = min(max(first_needed, 0) // self.block_size, len(seq.block_ids))
        released = 0
        for i in range(num_dead - 1, -1, -1):
            block_id = seq.block_ids[i]
            if block_id == NULL_BLOCK:
                break  # everything before it went back on an earlier step
            self._unref(block_id)
            seq.block_ids[i] = NULL_BLOCK
            released += 1
        return released

    def _unref(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
        elif self._ref_counts[block_id] < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running sequence's blocks to hold ``num_new_tokens`` more tokens; False if no room."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            seq.block_ids.append(self._next_block(seq))
        return True

    def blocks_to_fork(self, parent: Sequence) -> int:
        """Free blocks a fork of ``parent`` takes: one when its last block is partial (copy-on-write), else 0."""
        return 1 if len(parent.block_ids) > parent.num_computed_tokens // self.block_size else 0

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give ``child`` (a block-less copy of ``parent`` at the same token) the parent's blocks: full
        blocks shared by reference, the partial last block (if any) on a fresh block of its own, since both
        will write their next tokens there. Returns the (source, destination) blocks whose K/V the caller
        must copy, or None. Check ``blocks_to_fork`` against ``num_free_blocks`` first.
        """
        if child.block_ids:
            raise RuntimeError(f"request {child.request_id} already holds blocks")
        if self.blocks_to_fork(parent) > len(self._free):
            raise RuntimeError("no free block for the forked partial block")
        num_full = parent.num_computed_tokens // self.block_size
        for block_id in parent.block_ids[:num_full]:
            if block_id != NULL_BLOCK:
                self._ref_counts[block_id] += 1
        child.block_ids = list(parent.block_ids[:num_full])
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        if len(parent.block_ids) == num_full:
            return None
        child.block_ids.append(self._next_block(child))
        return parent.block_ids[num_full], child.block_ids[-1]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks are queued first so that they are evicted
        before the prefix blocks other requests are more likely to share."""
        for block_id in reversed(seq.block_ids):
            if block_id != NULL_BLOCK:
                self._unref(block_id)
        seq.block_ids = []
        seq.num_registered_blocks = 0
