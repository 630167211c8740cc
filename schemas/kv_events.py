"""KV-cache events: what each worker's prefix cache holds, by block hash, published on ``llm.kv_events`` so a router
can send a prompt to the worker that already has its leading blocks; and the control message that asks every worker
for a snapshot (a router that joins late, or that saw a gap in a worker's sequence numbers, catches up with it).

A hash is the engine's chained block hash (``sluicegate.block_hashes``; the chain's seed names the LoRA adapter),
hex-encoded: it names a whole prefix, so a worker holds a prompt's first ``n`` blocks when it holds their ``n``
hashes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field

from .common import SCHEMA_VERSION, Message, utcnow

#: Where a block sits: the engine's KV pool, or (offload tiers) host memory, local disk, a store shared by workers.
KVTier = Literal["pool", "host", "disk", "shared"]

BlockHash = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="A block's chained hash, hex.")]


class KVBlockStored(Message):
    """One block now cached, with its parent in the chain (None in a snapshot, which lists hashes alone)."""

    hash: BlockHash
    parent: str | None = Field(
        None, max_length=64, description="The parent block's hash, or the chain seed (hex) for a first block."
    )


class KVCacheEvents(Message):
    """One step's changes to a worker's cache in one tier, or (``snapshot``) everything that tier holds.

    ``seq`` counts this worker's messages from 0, so a reader sees a lost one as a gap and asks for a snapshot;
    a snapshot replaces what the reader knew of the worker's tier. ``cleared`` drops every block of the tier
    before ``stored`` and ``removed`` apply (stored first, then removed: a block may come and go in one step).
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    model: str = Field(min_length=1)
    worker_id: str = Field(min_length=1)
    seq: int = Field(ge=0, description="This worker's message number, from 0 at its start.")
    tier: KVTier = "pool"
    block_size: int = Field(ge=1, description="Tokens per block: a reader hashes prompts in blocks of this size.")
    snapshot: bool = False
    cleared: bool = False
    stored: list[KVBlockStored] = Field(default_factory=list)
    removed: list[BlockHash] = Field(default_factory=list)
    sent_at: AwareDatetime = Field(default_factory=utcnow)


class KVSnapshotRequest(Message):
    """Asks every worker (of ``model``, or of every model when None) to publish a snapshot of its cache: sent on
    ``llm.control`` beside cancels by a router that starts or that lost track of a worker."""

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["kv_snapshot"] = "kv_snapshot"
    model: str | None = None
    requested_by: str = Field(min_length=1, max_length=256)
    created_at: AwareDatetime = Field(default_factory=utcnow)
