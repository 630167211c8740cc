"""KV offload tiers: full KV blocks written down, as they fill, to a bounded host-memory tier, a bounded local-disk
tier and an optional store every worker of the model reads, and loaded back into the pool when a prefix lookup
misses it, before the engine would recompute them.

Every stored block is keyed by the namespace of what produced it (model, weights format, dtype, KV dtype and FP8
scales, tensor-parallel layout, block size: :mod:`.namespace`) and its chained block hash (which names the adapter
and the whole prefix), and framed with a checksum (:mod:`.codec`): a block of another configuration is never found,
a damaged one is refused and recomputed. The shared tier's client is injected (:class:`.tiers.BlockStore`): the
engine imports nothing of the pipeline, nor its Redis client.
"""

from .codec import BlockDamaged
from .config import KVOffloadConfig
from .for_engine import build_offloader
from .namespace import tier_namespace
from .offloader import KVOffloader, OffloadStats
from .tiers import BlockStore, DiskTier, HostTier

__all__ = [
    "BlockDamaged",
    "BlockStore",
    "DiskTier",
    "HostTier",
    "KVOffloadConfig",
    "KVOffloader",
    "OffloadStats",
    "build_offloader",
    "tier_namespace",
]
