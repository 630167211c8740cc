"""KV block accounting: ref counts, chained-hash prefix hits (capped before the last token),
least-recently-used eviction of free cached blocks, and hit counters."""

from __future__ import annotations

import itertools

import pytest

from gpu_workers.engine.core.block_manager import KVBlockManager, hash_block
from gpu_workers.engine.core.sequence import Sequence
from gpu_workers.engine.sampling_params import SamplingParams

_ids = itertools.count()
BS = 4


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(
        request_id=f"r{next(_ids)}",
        prompt=None,
        prompt_token_ids=list(tokens),
        params=SamplingParams(),
        priority=1,
        arrival_time=0.0,
        arrival_index=next(_ids),
        max_tokens=8,
        eos_token_ids=frozenset(),
        detokenizer=None,  # type: ignore[arg-type]  # block accounting never decodes
    )


def _run_prefill(bm: KVBlockManager, seq: Sequence) -> None:
    """Admit a sequence and pretend its whole prompt was computed."""
    hits = bm.lookup_prefix(seq)
    assert bm.allocate(seq, hits, seq.num_tokens - len(hits) * BS)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_allocate_and_free_restore_the_pool() -> None:
    bm = KVBlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = _seq(list(range(10)))
    assert bm.allocate(seq, [], 10)
    assert len(seq.block_ids) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.append_slots(seq, 3)  # 13 tokens -> 4 blocks
    assert len(seq.block_ids) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []
    assert all(bm.ref_count(b) == 0 for b in range(8))


def test_allocation_is_all_or_nothing() -> None:
    bm = KVBlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    seq = _seq(list(range(20)))
    assert not bm.allocate(seq, [], 20)  # needs 5 blocks
    assert seq.block_ids == [] and bm.num_free_blocks == 3
    assert bm.prefix_query_tokens == 0  # a failed admission is not counted as a lookup


def test_prefix_hits_are_chained_and_capped_before_the_last_token() -> None:
    bm = KVBlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = _seq(list(range(12)))
    _run_prefill(bm, a)
    # Same 12 tokens: only 2 of 3 full blocks may hit, the last token is recomputed.
    b = _seq(list(range(12)))
    hits = bm.lookup_prefix(b)
    assert hits == a.block_ids[:2]
    # Same first block, different second: the chain stops at the first mismatch even if a later
    # block's tokens happen to match.
    c = _seq([0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12])
    assert bm.lookup_prefix(c) == a.block_ids[:1]
    assert hash_block(b"", [4, 5, 6, 7]) != a.block_hashes[1]


def test_shared_blocks_are_ref_counted() -> None:
    bm = KVBlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = _seq(list(range(9)))
    _run_prefill(bm, a)
    b = _seq(list(range(9)))
    _run_prefill(bm, b)
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared
    assert all(bm.ref_count(x) == 2 for x in shared)
    assert b.num_computed_tokens == 9 and bm.prefix_hit_tokens == 8 and bm.prefix_query_tokens == 18
    assert bm.prefix_hit_rate == pytest.approx(8 / 18)
    bm.free(a)
    assert all(bm.ref_count(x) == 1 for x in shared)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_free_cached_blocks_are_reused_until_evicted_lru_first() -> None:
    bm = KVBlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = _seq(list(range(100, 113)))  # 13 tokens: 3 full blocks + 1 partial
    _run_prefill(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    # Still findable while free.
    again = _seq(list(range(100, 113)))
    assert bm.lookup_prefix(again) == a_blocks[:3]
    # New blocks come from free blocks without cached content first (a's partial block, then
    # never-used ones); cached blocks are evicted only after those, and a's tail before its head.
    filler = _seq(list(range(200, 208)))  # 2 blocks
    assert bm.allocate(filler, [], 8)
    assert bm.lookup_prefix(again) == a_blocks[:3]
    one_more = _seq(list(range(300, 304)))
    assert bm.allocate(one_more, [], 4)  # the last block without cached content
    assert bm.lookup_prefix(again) == a_blocks[:3]
    another = _seq(list(range(400, 404)))
    assert bm.allocate(another, [], 4)  # now a's third full block goes
    assert bm.lookup_prefix(again) == a_blocks[:2]
    for s in (filler, one_more, another):
        bm.free(s)
    assert bm.num_free_blocks == 6


def test_blocks_of_a_sequence_are_placed_consecutively() -> None:
    bm = KVBlockManager(num_blocks=64, block_size=BS, enable_prefix_caching=False)
    seqs = [_seq(list(range(10 * i, 10 * i + 6))) for i in range(3)]  # 6 prompt + 8 max -> 4 blocks
    for seq in seqs:
        assert bm.allocate(seq, [], 6)  # 2 blocks each, room left for growth
    for seq in seqs:
        seq.num_computed_tokens = 6
        assert bm.append_slots(seq, 8)  # grow to 14 tokens
    for seq in seqs:
        assert seq.block_ids == list(range(seq.block_ids[0], seq.block_ids[0] + 4))
    for seq in seqs:
        bm.free(seq)


def test_hit_on_a_free_cached_block_counts_against_free_space() -> None:
    bm = KVBlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = _seq(list(range(9)))
    _run_prefill(bm, a)
    bm.free(a)
    b = _seq(list(range(9)))
    hits = bm.lookup_prefix(b)
    assert len(hits) == 2
    # 2 hit blocks come out of the free queue, 1 new block needed: exactly fits.
    assert bm.allocate(b, hits, 1)
    assert bm.num_free_blocks == 0
    c = _seq(list(range(50, 54)))
    assert not bm.allocate(c, [], 4)
    bm.free(b)
    assert bm.num_free_blocks == 3


def test_disabled_prefix_caching_never_hits() -> None:
    bm = KVBlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = _seq(list(range(9)))
    _run_prefill(bm, a)
    b = _seq(list(range(9)))
    assert bm.lookup_prefix(b) == []
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.prefix_hit_rate == 0.0
