"""A step of the deterministic mode cut into row batches for the compiled CPU graph: one row per token.

The compiled graph of a CPU step (``cpu_decode_compile.py``) attends one query per row. Under the deterministic mode
every step goes through it, prompt tokens included, so a prompt token is computed exactly as a decode step at its
position would compute it (``attention/gathered_invariant.py``): a prefill of N tokens gives the keys, values and
logits of N decode steps, whatever the chunking, prefix-cache hits, preemption or the rest of the batch.

Each token becomes a row with its sequence's block table and its own context length (position + 1). Rows keep the
prepared step's order, so the hidden states they give line up with its logits rows and pooled spans. A step longer
than the graph's row limit runs as several batches in order, each storing its keys and values before the next
reads them; a row's ``fresh_from`` is where the keys its own batch computes begin.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..attention.metadata import AttentionMetadata


@dataclass
class TokenRows:
    """A batch of token rows, shaped as a prepared decode batch (``cpu_decode_compile.DecodeBatch``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def _rows_meta(
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, fresh_from: torch.Tensor
) -> AttentionMetadata:
    """Metadata of a batch whose every row is one query token with its own context."""
    rows = slot_mapping.shape[0]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=slot_mapping.device),
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        is_decode_only=True,
        fresh_from=fresh_from,
    )


def token_rows(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, max_rows: int
) -> Iterator[TokenRows]:
    """The step's tokens (``input_ids`` / ``positions`` over the sequences of ``meta``) as batches of at most
    ``max_rows`` rows, in order."""
    query_start = meta.query_start_loc.to(torch.int64)
    lengths = query_start[1:] - query_start[:-1]
    sequence = torch.repeat_interleave(torch.arange(lengths.shape[0], device=input_ids.device), lengths)
    seq_first = query_start[:-1][sequence]  # each token's sequence's first token in the step
    total = int(input_ids.shape[0])
    for lo in range(0, total, max_rows):
        hi = min(lo + max_rows, total)
        first = positions[seq_first[lo:hi].clamp(min=lo)]
        seq_lens = (positions[lo:hi] + 1).to(torch.int32)
        batch_meta = _rows_meta(meta.slot_mapping[lo:hi], seq_lens, meta.block_tables[sequence[lo:hi]], first)
        yield TokenRows(input_ids[lo:hi], positions[lo:hi], batch_meta)


def with_companion(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> TokenRows:
    """A lone row with a throwaway second one, so that the deterministic mode keeps to its one many-row graph: the
    companion (token 0 at position 0) attends only to its own key; the caller drops its hidden state and never
    stores its K/V."""
    if meta.fresh_from is None:
        raise RuntimeError("the deterministic mode's rows carry fresh_from")

    def twice(tensor: torch.Tensor, other: int) -> torch.Tensor:
        return torch.cat([tensor, torch.full_like(tensor[:1], other)])

    companion = _rows_meta(
        twice(meta.slot_mapping, 0), twice(meta.seq_lens, 1), twice(meta.block_tables, 0), twice(meta.fresh_from, 0)
    )
    return TokenRows(twice(input_ids, 0), twice(positions, 0), companion)
