"""The engine's KV cache built: how many blocks it gets, one pool or a hybrid pool per layer group, the draft
model's mirror of it, and the offload tiers behind it. The engine calls these once, at start-up, in this order."""

from __future__ import annotations

import logging

import torch

from .config import EngineConfig
from .core.block_manager import KVBlockManager
from .core.kv_groups import HybridKVBlockManager, kv_group_layout, split_kv_pool
from .execution.model_runner import ModelRunner
from .kv_offload import build_offloader
from .kv_offload.offloader import KVOffloader
from .models.loader import LoadedModel
from .spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)


def build_kv_cache(
    config: EngineConfig,
    loaded: LoadedModel,
    runner: ModelRunner,
    draft: DraftModelProposer | None,
    tensor_parallel: bool,
) -> KVBlockManager | HybridKVBlockManager:
    """Size the cache (the configured block count, or what memory leaves once the weights, and a draft model's,
    are in), allocate it in the runner (and the draft's, one block for each of the target's), and return the block
    manager over it. A ``ValueError`` when it cannot hold one request of the model's length."""
    block_size, max_model_len = config.block_size, loaded.max_model_len
    num_blocks = config.num_kv_blocks or runner.profile_num_blocks(
        config, max_model_len, extra_bytes_per_block=draft.bytes_per_block if draft else 0
    )
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens) "
            f"cannot hold one request of max_model_len={max_model_len} tokens; give it more blocks "
            "(num_kv_blocks, cpu_kv_cache_gb or gpu_memory_utilization) or lower max_model_len"
        )
    # A draft model's cache and tensor-parallel followers mirror one block table: they keep one group.
    layout = kv_group_layout(loaded.sliding_windows) if config.enable_hybrid_kv_cache else None
    if layout is not None and (draft is not None or tensor_parallel):
        logger.info("hybrid KV cache off: speculative drafts and tensor parallelism mirror one block table")
        layout = None
    block_manager: KVBlockManager | HybridKVBlockManager
    if layout is None:
        runner.allocate_kv_cache(num_blocks)
        block_manager = KVBlockManager(
            num_blocks, block_size, config.enable_prefix_caching, sliding_window=loaded.release_window
        )
    else:
        split = split_kv_pool(num_blocks, layout, block_size, config.max_num_seqs, config.max_num_batched_tokens)
        runner.allocate_hybrid_kv_cache(layout, split)
        block_manager = HybridKVBlockManager(*split, block_size, config.enable_prefix_caching, layout.window)
    if draft is not None:
        draft.allocate_kv_cache(num_blocks)
    return block_manager


def attach_offloader(
    config: EngineConfig,
    runner: ModelRunner,
    model_dtype: torch.dtype,
    block_manager: KVBlockManager | HybridKVBlockManager,
) -> KVOffloader | None:
    """The offload tiers the config asks for, set as the block manager's tier (None without tiers)."""
    offloader = build_offloader(config, runner, model_dtype, block_manager.record_kv_events)
    if offloader is not None and isinstance(block_manager, HybridKVBlockManager):
        # The tiers copy one block table's rows of one set of KV tensors; a hybrid cache has a table and tensors
        # per layer group.
        raise ValueError(
            "KV offload tiers are not supported with the hybrid KV cache of a model mixing sliding and global "
            "layers; turn the tiers off, or the hybrid cache (enable_hybrid_kv_cache=False)"
        )
    block_manager.tier = offloader
    return offloader
