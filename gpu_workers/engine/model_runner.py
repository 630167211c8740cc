"""Turns a scheduled batch into model inputs, owns the paged KV cache, and runs the forward pass.

The batch is flat and unpadded: decode sequences (one new token) first, then prefill chunks.
Logits are computed only for rows that sample: the last token of each sequence whose prompt (or
recompute) is now fully in the cache. Decode input preparation lives in ``_prepare_decode`` so a
CUDA-graph runner can reuse it with padded, static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.base import AttentionBackend
from .attention.metadata import AttentionMetadata
from .config import EngineConfig
from .models.loader import LoadedModel
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=loaded.dtype).element_size()
    return 2 * loaded.num_layers * block_size * loaded.num_kv_heads * loaded.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, backend: AttentionBackend, block_size: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.backend = backend
        self.block_size = block_size
        self.device = next(self.model.parameters()).device
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        for layer in self.model.attention_layers:
            layer.backend = backend

    # ------------------------------------------------------------------ KV cache
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One ``[2, layers, blocks, block_size, kv_heads, head_dim]`` tensor, viewed per layer.

        Zero-filled: padded block-table entries and partly filled blocks are read (then masked), and
        masked garbage could be NaN, which a zero attention weight does not cancel.
        """
        lm = self.loaded
        self.kv_cache = torch.zeros(
            2, lm.num_layers, num_blocks, self.block_size, lm.num_kv_heads, lm.head_dim,
            dtype=lm.dtype, device=self.device,
        )  # fmt: skip
        self.num_blocks = num_blocks
        for i, layer in enumerate(self.model.attention_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]

    def profile_num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        """How many KV blocks fit: a share of free GPU memory after a full-budget forward, or the
        configured CPU share (never more than ``max_num_seqs`` full-length sequences need)."""
        per_block = kv_bytes_per_block(self.loaded, self.block_size)
        max_useful = config.max_num_seqs * -(-max_model_len // self.block_size)
        if self.device.type != "cuda":
            return max(1, min(int(config.cpu_kv_cache_gb * (1 << 30)) // per_block, max_useful))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_forward(min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len), max_model_len)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free
        budget = int(total * config.gpu_memory_utilization) - used_elsewhere - activation_peak
        return max(0, min(budget // per_block, max_useful))

    def _profile_forward(self, num_tokens: int, max_model_len: int) -> None:
        """A throw-away forward of ``num_tokens`` fresh prefill tokens against a one-block cache
        (every slot is -1, so nothing is stored) to measure peak activation memory."""
        self.allocate_kv_cache(1)
        lens = []
        remaining = num_tokens
        while remaining > 0:
            lens.append(min(remaining, max_model_len))
            remaining -= lens[-1]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            # All rows point at block 0: wide enough that no backend indexes past the table.
            block_tables=torch.zeros((len(lens), -(-max(lens) // self.block_size)), dtype=torch.int32, device=dev),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lens,
        )
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta)
            self.model.compute_logits(hidden[torch.tensor([s - 1 for s in starts[1:]], device=dev)])
        self.kv_cache = None
        for layer in self.model.attention_layers:
            layer.k_cache = layer.v_cache = None

    # ------------------------------------------------------------------ inputs
    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        pairs = list(zip(batch.seqs, batch.num_new_tokens, strict=True))
        if all(n == 1 for _, n in pairs):
            return self._prepare_decode([s for s, _ in pairs])
        # Decode rows first: the torch backend then handles them with slices, not gathers.
        pairs.sort(key=lambda p: p[1] != 1)
        return self._prepare_mixed(pairs)

    def _prepare_decode(self, seqs: list[Sequence]) -> PreparedBatch:
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
        n = len(seqs)
        query_start = list(range(n + 1))
        sample = [seq for seq in seqs if seq.num_computed_tokens + 1 == seq.num_tokens]
        logits_rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
        return self._build(input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, sample, 1)

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
        for seq, n in pairs:
            start = seq.num_computed_tokens
            end = start + n
            blocks = seq.block_ids
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if end == seq.num_tokens:
                logits_rows.append(query_start[-1] - 1)
                sample.append(seq)
        max_q = max(n for _, n in pairs)
        return self._build(input_ids, positions, slots, query_start, seq_lens, tables, logits_rows, sample, max_q)

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
        )
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            sample_seqs=sample,
        )

    # ------------------------------------------------------------------ forward
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run one step; return the sequences that sample and their float32 logits (or None)."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not allocated")
        prepared = self.prepare(batch)
        with torch.inference_mode():
            hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta)
            if not prepared.sample_seqs:
                return [], None
            logits = self.model.compute_logits(hidden[prepared.logits_indices])
        return prepared.sample_seqs, logits.float()
