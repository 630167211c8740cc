"""A scheduled batch as the tensors and attention metadata of one forward, built on the host.

The batch is flat and unpadded: decode sequences (one new token) first, then prefill chunks. Logits are computed only
for rows that sample: the last token of each sequence whose prompt (or recompute) is now fully in the cache. Decode
rows are gathered by ``_decode_rows``, which the CUDA-graph path (``cuda_graphs.py``) shares.

Decode steps whose sequences all start with the same physical blocks (a shared system prompt served from the prefix
cache) carry ``common_prefix_len`` in their metadata, worked out here from the host block tables (no device sync),
so a backend with a cascade path (Triton) attends that prefix once for the whole batch instead of once per sequence.

``StepInputs`` is the model runner's half that does this (``model_runner.py`` extends it); a tensor-parallel rank
overrides ``_build`` to send its plan to the other ranks, and a draft model builds its own steps with it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from ..attention.metadata import AttentionMetadata
from ..core.kv_groups import KVGroupLayout
from ..core.scheduler import ScheduledBatch
from ..core.sequence import Sequence
from .cuda_graphs import DecodeRows
from .kv_group_cache import group_metadata
from .pooler import PoolSpan

# Smallest shared prefix (tokens) and batch worth a cascade pass: below them the extra prefix
# launch and merge per layer cost more than reading the prefix once per sequence saves.
CASCADE_MIN_PREFIX_LEN = 256
CASCADE_MIN_SEQS = 4

CommonPrefixFn = Callable[[SequenceABC[SequenceABC[int]], SequenceABC[int], int], int]


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]
    # Rows of embedding requests' prefill chunks (they pool instead of sampling).
    pool_spans: list[PoolSpan] = field(default_factory=list)
    # (sequence, new tokens) in the batch's token order: which adapter each token uses.
    runs: list[tuple[Sequence, int]] = field(default_factory=list)


class StepInputs:
    """Builds a step's inputs; the attributes below are the model runner's."""

    device: torch.device
    block_size: int
    use_cascade: bool
    cascade_min_prefix_len: int
    cascade_min_seqs: int
    _common_prefix_len: CommonPrefixFn | None
    kv_layout: KVGroupLayout | None

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        pairs = list(zip(batch.seqs, batch.num_new_tokens, strict=True))
        if all(n == 1 for _, n in pairs) and not any(s.pooling is not None for s, _ in pairs):
            prepared = self._prepare_decode([s for s, _ in pairs])
        else:
            # Decode rows first: the torch backend then handles them with slices, not gathers.
            pairs.sort(key=lambda p: p[1] != 1)
            prepared = self._prepare_mixed(pairs)
        prepared.runs = pairs
        return prepared

    def _decode_rows(self, seqs: list[Sequence]) -> DecodeRows:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq in seqs:
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(seq.block_ids)
        # Each row's cached context is its position: the new token is the only query.
        return DecodeRows(input_ids, positions, slots, seq_lens, tables, self._decode_common_prefix(tables, positions))

    def _decode_common_prefix(self, tables: list[list[int]], context_lens: list[int]) -> int:
        if self._common_prefix_len is None or not self.use_cascade or len(tables) < max(2, self.cascade_min_seqs):
            return 0
        prefix = self._common_prefix_len(tables, context_lens, self.block_size)
        return prefix if prefix >= self.cascade_min_prefix_len else 0

    def _prepare_decode(self, seqs: list[Sequence]) -> PreparedBatch:
        rows = self._decode_rows(seqs)
        query_start = list(range(len(seqs) + 1))
        sample = [seq for seq in seqs if seq.num_computed_tokens + 1 == seq.num_tokens]
        logits_rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
        return self._build(
            rows.input_ids,
            rows.positions,
            rows.slots,
            query_start,
            rows.seq_lens,
            rows.block_tables,
            logits_rows,
            sample,
            1,
            common_prefix_len=rows.common_prefix_len,
            group_tables=self._group_tables(seqs),
        )

    def _group_tables(self, seqs: list[Sequence]) -> list[list[list[int]]] | None:
        """Per KV group past the first, each sequence's block table (None without a hybrid cache)."""
        if self.kv_layout is None:
            return None
        return [[seq.kv_group_views[0].block_ids for seq in seqs]]

    def _prepare_mixed(self, pairs: list[tuple[Sequence, int]]) -> PreparedBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sample: list[Sequence] = []
        spans: list[PoolSpan] = []
        for seq, n in pairs:
            start = seq.num_computed_tokens
            end = start + n
            blocks = seq.block_ids
            # A decode with drafts feeds [last token, drafts...] and needs a logit row for each (verification).
            num_spec = len(seq.spec_token_ids)
            tokens = seq.token_ids + seq.spec_token_ids if num_spec else seq.token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if seq.pooling is not None:
                spans.append(PoolSpan(seq, query_start[-2], query_start[-1], start))
            elif end == seq.num_tokens + num_spec:
                logits_rows.extend(range(query_start[-1] - 1 - num_spec, query_start[-1]))
                sample.append(seq)
        max_q = max(n for _, n in pairs)
        prepared = self._build(
            input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, sample, max_q,
            group_tables=self._group_tables([seq for seq, _ in pairs]),
        )  # fmt: skip
        prepared.pool_spans = spans
        return prepared

    def _build(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_start: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        logits_rows: list[int],
        sample: list[Sequence],
        max_query_len: int,
        *,
        common_prefix_len: int = 0,
        group_tables: list[list[list[int]]] | None = None,
    ) -> PreparedBatch:
        dev = self.device
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            is_decode_only=max_query_len == 1,
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
            common_prefix_len=common_prefix_len,
        )
        if group_tables:
            meta.kv_groups = tuple(
                group_metadata(meta, g + 1, t, positions, query_start, self.block_size)
                for g, t in enumerate(group_tables)
            )
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            sample_seqs=sample,
        )
