"""The engine's KV events as one value per step: the prefix cache's journal (blocks cached, evicted) with, nested,
the offload tiers' (blocks written down, dropped), and the snapshot of both that a worker publishes at start (a
restarted worker's disk tier included) and when a router asks."""

from __future__ import annotations

from .core.block_manager import KVBlockManager
from .kv_offload import KVOffloader
from .outputs import KVCacheEvents


def take_events(block_manager: KVBlockManager, offloader: KVOffloader | None) -> KVCacheEvents | None:
    """The pool's and the tiers' changes since the last call; None when nothing changed or events are off."""
    if not block_manager.record_kv_events:
        return None
    block_size = block_manager.block_size
    stored, removed = block_manager.take_kv_events()
    tiers = offloader.take_events() if offloader is not None else {}
    if not stored and not removed and not tiers:
        return None
    below = [KVCacheEvents(block_size, s, r, tier=t) for t, (s, r) in tiers.items()]
    return KVCacheEvents(block_size, stored, removed, tiers=below)


def snapshot(block_manager: KVBlockManager, offloader: KVOffloader | None) -> KVCacheEvents:
    """Every block the pool holds, and (in ``tiers``) what the local tiers hold; the events that follow continue
    from it. Empty when events are off."""
    block_size = block_manager.block_size
    if not block_manager.record_kv_events:
        return KVCacheEvents(block_size, snapshot=True)
    hashes = block_manager.cached_hashes()
    held = offloader.snapshot() if offloader is not None else {}
    below = [KVCacheEvents(block_size, [(h, b"") for h in hs], tier=t, snapshot=True) for t, hs in held.items()]
    return KVCacheEvents(block_size, [(h, b"") for h in hashes], snapshot=True, tiers=below)
