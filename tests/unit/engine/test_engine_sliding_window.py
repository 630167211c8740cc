"""Sliding-window attention in the KV cache: with every layer sliding, the blocks behind the window go back
to the pool (``NULL_BLOCK`` in their place), the released blocks stay findable by prefix lookups until
evicted, a lookup never returns a prefix with a block missing, and the window no longer caps the context.
Token-for-token parity with transformers runs in test_engine_vs_transformers.py (``mistral_sliding``,
``phi3_sliding``, ``mixtral_sliding``); Qwen3-MoE's window (``use_sliding_window``) is checked here."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.core.block_manager import NULL_BLOCK, KVBlockManager
from gpu_workers.engine.models.loader import resolve_max_model_len
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .conftest import MODEL_VARIANTS, HFReference
from .test_engine_block_manager import _seq

BS = 4


def test_blocks_wholly_behind_the_window_are_released_once() -> None:
    bm = KVBlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False, sliding_window=6)
    seq = _seq(list(range(20)))
    assert bm.allocate(seq, [], 20)
    seq.num_computed_tokens = 20
    # The next query (position 20) sees 15..20: blocks 0-2 (positions 0..11) are dead, block 3 (12..15) is not.
    assert bm.release_out_of_window(seq) == 3
    assert seq.block_ids[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in seq.block_ids[3:]
    assert bm.num_free_blocks == 16 - 2
    assert bm.release_out_of_window(seq) == 0  # nothing new until the window moves on
    assert bm.append_slots(seq, 1)
    seq.num_computed_tokens = 21
    assert bm.release_out_of_window(seq) == 1
    bm.free(seq)
    assert bm.num_free_blocks == 16 and all(bm.ref_count(b) == 0 for b in range(16))


def test_without_a_window_nothing_is_released() -> None:
    bm = KVBlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    seq = _seq(list(range(20)))
    assert bm.allocate(seq, [], 20)
    seq.num_computed_tokens = 20
    assert bm.release_out_of_window(seq) == 0 and NULL_BLOCK not in seq.block_ids


def test_released_blocks_stay_cached_and_a_lookup_never_skips_a_missing_block() -> None:
    bm = KVBlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, sliding_window=5)
    tokens = list(range(17))
    first = _seq(tokens)
    assert bm.allocate(first, [], 17)
    first.num_computed_tokens = 17
    bm.cache_computed_blocks(first)
    released_ids = list(first.block_ids[:3])
    assert bm.release_out_of_window(first) == 3
    # Released, not forgotten: a second request with the same prompt finds all four whole blocks.
    again = _seq(tokens)
    assert bm.lookup_prefix(again) == [*released_ids, first.block_ids[3]]
    # A filler takes the three fresh blocks, then evicts the least recently released one: the third
    # (released tail first). The chain breaks there: the hit stops before it, with no hole in it.
    filler = _seq(list(range(100, 100 + 4 * BS)))
    assert bm.allocate(filler, [], 4 * BS)
    assert released_ids[2] in filler.block_ids and not set(released_ids[:2]) & set(filler.block_ids)
    assert bm.lookup_prefix(_seq(tokens)) == released_ids[:2]
    for seq in (first, filler):
        bm.free(seq)
    assert bm.num_free_blocks == 8


def test_a_long_prefix_hit_gives_back_what_lies_behind_the_window_at_once() -> None:
    bm = KVBlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True, sliding_window=4)
    tokens = list(range(33))
    first = _seq(tokens)
    assert bm.allocate(first, [], 33)
    first.num_computed_tokens = 33
    bm.cache_computed_blocks(first)
    bm.free(first)
    second = _seq(tokens)
    hits = bm.lookup_prefix(second)
    assert len(hits) == 8
    assert bm.allocate(second, hits, 1)
    # Computed up to 32: the next query sees 29..32, so blocks 0..6 (positions 0..27) went back.
    assert second.block_ids[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in second.block_ids[7:]
    bm.free(second)
    assert bm.num_free_blocks == 16


def test_window_no_longer_caps_the_context(model_dir: Callable[[str], Path]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir("mistral_sliding")))
    assert config.sliding_window == MODEL_VARIANTS["mistral_sliding"]["sliding_window"]
    assert resolve_max_model_len(config, None) == config.max_position_embeddings


def test_engine_holds_only_the_window_s_blocks_while_decoding(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    window = MODEL_VARIANTS["mistral_sliding"]["sliding_window"]
    llm = make_llm(model_dir("mistral_sliding"), enable_prefix_caching=False, max_num_batched_tokens=64)
    engine = llm.engine
    block_size = engine.block_manager.block_size
    assert engine.block_manager.sliding_window == window
    rng = random.Random(7)
    engine.add_request([rng.randrange(3, 512) for _ in range(200)], SamplingParams(max_tokens=60, ignore_eos=True))
    most_held = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            most_held = max(most_held, sum(b != NULL_BLOCK for b in seq.block_ids))
    # Whole blocks of the window plus the partial ones at either end, and a 64-token chunk's worth at most
    # during the prefill: far fewer than the 260 tokens' 17 blocks a full-attention model holds.
    bound = -(-(window + 64) // block_size) + 1
    assert 0 < most_held <= bound < -(-260 // block_size)


@pytest.mark.parametrize("variant", ["mistral_sliding", "phi3_sliding", "mixtral_sliding"])
def test_every_layer_of_an_all_sliding_model_slides_and_releases(
    variant: str, model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    window = MODEL_VARIANTS[variant]["sliding_window"]
    engine = make_llm(model_dir(variant)).engine
    assert engine.loaded.sliding_windows == [window] * engine.loaded.num_layers
    assert engine.block_manager.sliding_window == window
    assert engine.loaded.max_model_len > window


def test_qwen3_moe_window_matches_transformers(
    tmp_path: Path, hf_reference: HFReference, make_llm: Callable[..., LLM]
) -> None:
    window = 24
    path = make_tiny_model(tmp_path / "qwen3_moe_sliding", arch="qwen3_moe", seed=7, head_dim=32, sliding_window=window)
    llm = make_llm(path)
    assert llm.engine.block_manager.sliding_window == window
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (90, 17)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outputs] == [hf_reference.greedy(path, p, 12) for p in prompts]
