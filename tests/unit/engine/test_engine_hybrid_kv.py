"""The hybrid KV cache (``core/kv_groups.py``): Gemma 3's full and sliding layers get a block table and pool each,
the sliding group holds only its window (measured at 8k tokens against the projected figure), a prefix hit is
shortened to what both groups still hold, and models of one layer kind keep the single-group manager. Greedy
parity with transformers for the hybrid ``gemma3`` variant runs in test_engine_vs_transformers.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from gpu_workers.engine.core.block_manager import NULL_BLOCK, KVBlockManager
from gpu_workers.engine.core.kv_groups import HybridKVBlockManager, kv_group_layout, sliding_view, split_kv_pool
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .test_engine_block_manager import _seq

BS = 4


def test_layouts_group_only_mixed_models() -> None:
    layout = kv_group_layout([48, None, 48])
    assert layout is not None and layout.layer_groups == (1, 0, 1) and layout.window == 48
    assert kv_group_layout([None, None]) is None and kv_group_layout([48, 48]) is None
    assert kv_group_layout([48, 96, None]) is None  # several windows: one full group


def test_pool_split_gives_the_sliding_group_what_it_can_use_and_the_rest_to_the_full_group() -> None:
    layout = kv_group_layout([512] * 5 + [None])
    assert layout is not None
    full, sliding = split_kv_pool(1000, layout, 16, max_num_seqs=2, max_num_batched_tokens=512)
    assert sliding == 2 * (32 + 2) + 32
    assert full == 1000 * 6 - sliding * 5  # one full layer: the layer-blocks the sliding group leaves
    # A pool too small for that need splits evenly: never fewer full blocks than an all-global cache.
    assert split_kv_pool(50, layout, 16, max_num_seqs=8, max_num_batched_tokens=512) == (50, 50)


def test_engines_pick_the_hybrid_manager_for_gemma3_only(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    assert isinstance(make_llm(model_dir("gemma3")).engine.block_manager, HybridKVBlockManager)
    assert type(make_llm(model_dir("llama")).engine.block_manager) is KVBlockManager


def test_a_prefix_hit_is_shortened_to_what_the_sliding_group_still_holds() -> None:
    bm = HybridKVBlockManager(full_blocks=32, sliding_blocks=8, block_size=BS, enable_prefix_caching=True, window=6)
    tokens = list(range(1, 26))  # 6 full blocks and a partial one
    first = _seq(tokens)
    assert bm.allocate(first, [], len(tokens))
    first.num_computed_tokens = len(tokens)
    bm.cache_computed_blocks(first)
    assert bm.release_out_of_window(first) == 5  # the next query (position 25) sees 20..25
    assert sliding_view(first).block_ids[:5] == [NULL_BLOCK] * 5
    bm.free(first)
    # Everything is still cached: the whole 6-block prefix hits, with only its window taken in the sliding group.
    again = _seq(tokens)
    hits = bm.lookup_prefix(again)
    assert len(hits) == 6
    assert bm.allocate(again, hits, len(tokens) - 6 * BS)
    assert sliding_view(again).block_ids[:4] == [NULL_BLOCK] * 4
    bm.free(again)
    # A filler takes every sliding block, evicting the prefix there: the full group alone cannot make a hit.
    filler = _seq(list(range(100, 100 + 8 * BS)))
    assert bm.allocate(filler, [], 8 * BS)
    bm.free(filler)
    assert bm.lookup_prefix(_seq(tokens)) == []
    assert bm.full.num_cached_blocks >= 6


@pytest.mark.slow
def test_an_8k_request_holds_the_projected_blocks_per_group(tmp_path: Path) -> None:
    context, window, chunk, bs = 8192, 512, 512, 16
    folder = make_tiny_model(
        tmp_path / "gemma3", arch="gemma3", num_layers=6, head_dim=32, sliding_window=window,
        max_position_embeddings=context + 1,
    )  # fmt: skip
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), max_model_len=context + 1, num_kv_blocks=context // bs + 8, block_size=bs,
            max_num_batched_tokens=chunk, max_num_seqs=2, enable_prefix_caching=False, dtype="float32",
        )
    )  # fmt: skip
    bm = engine.block_manager
    assert isinstance(bm, HybridKVBlockManager)
    prompt = [random.Random(0).randrange(3, 500) for _ in range(context - 32)]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    peak_sliding = 0
    full = sliding = 0
    while engine.has_unfinished():
        engine.step()
        if engine.scheduler.running:
            full, sliding = bm.group_blocks_in_use()
            peak_sliding = max(peak_sliding, sliding)
    # Projected: every block in the full group; the window plus the block it starts in (and, while prefilling,
    # a chunk beside it) in the sliding group.
    assert full == context // bs
    assert window // bs <= sliding <= window // bs + 2
    assert peak_sliding <= (window + chunk) // bs + 2


def test_offload_tiers_are_refused_by_name_with_the_hybrid_cache(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="KV offload tiers are not supported with the hybrid KV cache"):
        LLM(str(model_dir("gemma3")), max_model_len=256, num_kv_blocks=64, kv_offload={"host_bytes": 1 << 20})
