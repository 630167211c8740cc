"""The KV block hash chain, in the one place both the engine and the router read it: a full block's hash names
its whole prefix (its tokens chained on its parent's hash), and the chain's seed names the LoRA adapter, so K/V
computed under different adapters never share a hash.

The engine hashes the blocks it caches with it; the router hashes an incoming prompt with it to find which
worker holds the longest cached prefix. It imports the standard library only: the engine, which imports nothing
of the pipeline, may import this module (``tests/unit/test_import_arrows.py`` names it as the one exception).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Content hash of one full block, chained on its parent's hash so it names the whole prefix."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_seed(lora_int_id: int) -> bytes:
    """The parent hash of a sequence's first block: empty for the base model, the adapter's id under a LoRA
    adapter, so K/V computed under different adapters (or none) never share a block and one adapter's do."""
    return b"" if lora_int_id == 0 else b"lora:" + lora_int_id.to_bytes(8, "little")


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, lora_int_id: int = 0, max_blocks: int | None = None
) -> list[bytes]:
    """The chained hashes of a prompt's full blocks the engine could serve from its cache: like the engine's
    lookup, never the block holding the last token (the model must run at least one token)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    count = max(len(token_ids) - 1, 0) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[bytes] = []
    parent = chain_seed(lora_int_id)
    for i in range(count):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
