"""The model runner's side of a hybrid KV cache (``core/kv_groups.py``): one KV tensor per layer group, sized
for its layers and its own block count, and per-step attention metadata for every group past the first."""

from __future__ import annotations

import dataclasses

import torch

from ..attention.metadata import AttentionMetadata
from ..core.kv_groups import KVGroupLayout


def allocate_group_caches(
    layout: KVGroupLayout,
    group_blocks: tuple[int, ...],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """A zero-filled ``[2, group layers, group blocks, block_size, kv_heads, head_dim]`` tensor per group, and
    per attention layer its (group, index in that group's tensor)."""
    caches = []
    for group, num_blocks in enumerate(group_blocks):
        num_layers = len(layout.layers_of(group))
        caches.append(
            torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        )
    seen = [0] * len(group_blocks)
    places = []
    for group in layout.layer_groups:
        places.append((group, seen[group]))
        seen[group] += 1
    return caches, places


def group_metadata(
    meta: AttentionMetadata,
    group: int,
    tables: list[list[int]],
    positions: list[int],
    query_start: list[int],
    block_size: int,
) -> AttentionMetadata:
    """Group ``group``'s metadata for the step ``meta`` (group 0's) describes: the same queries and lengths,
    slots and block tables from the group's own tables (``NULL_BLOCK`` entries stay: never read)."""
    slots: list[int] = []
    for i, table in enumerate(tables):
        for p in positions[query_start[i] : query_start[i + 1]]:
            slots.append(table[p // block_size] * block_size + p % block_size)
    dev = meta.slot_mapping.device
    width = max(len(t) for t in tables)
    return dataclasses.replace(
        meta,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        kv_groups=(),
        kv_group=group,
    )
