"""The per-step description of a flat, unpadded token batch that every attention backend reads.

Layout contract shared by all backends (torch reference, Triton, flash-attn):

* The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (flash-attn's paged layout).
* A token's *slot* is ``block_id * block_size + offset_in_block``.
* The batch holds ``num_seqs`` sequences; sequence ``i`` contributes the query tokens
  ``query_start_loc[i]:query_start_loc[i + 1]`` of the flat ``q``/``k``/``v`` tensors. Those are
  the *last* ``q_len_i`` tokens of a context of ``seq_lens[i]`` tokens (prefix-cache hits and
  earlier chunks/decode steps are already in the cache), so query ``j`` of sequence ``i`` sits at
  absolute position ``seq_lens[i] - q_len_i + j`` and attends causally to positions ``<=`` that.
* ``block_tables[i, b]`` is the physical block holding positions ``b*block_size ..`` of sequence
  ``i``; rows are padded with ``0`` past the sequence's last block (never read).
* ``common_prefix_len > 0`` promises that every sequence's block table starts with the same
  ``common_prefix_len // block_size`` physical blocks and that no query sits inside them, so a
  backend may attend that shared prefix once for the whole batch (cascade attention). Backends
  without a cascade path ignore it.
* A hybrid KV cache (``core/kv_groups.py``: full-attention and sliding layers in separate pools) gives each
  layer group its own slots and block tables: the metadata the model receives is group 0's and carries the
  other groups' in ``kv_groups``; a layer reads ``meta.for_group(its group)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything a backend needs to write this step's K/V into the cache and attend over it."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token's K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_seqs] int32: context length per sequence, new tokens included
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # True when every sequence contributes exactly one query token (pure decode step).
    is_decode_only: bool = False
    # Host copies, so backends that loop in Python do not sync the device per sequence.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Tokens (whole blocks) every sequence shares physically; 0 = no shared-prefix pass.
    common_prefix_len: int = 0
    # The same length as a one-element int32 device tensor that kernels read at run time; set in
    # CUDA graphs, whose launches are fixed at capture while the length changes between replays.
    # ``common_prefix_len`` then only says that the cascade path is on (any positive multiple of
    # the block size), and a device value of 0 makes the shared-prefix pass empty.
    common_prefix_len_device: torch.Tensor | None = None
    # FP8 KV cache only: each layer sets its K/V scales from this step's new K/V before writing them
    # (the model runner asks once, on the cache's first step; see ``kv_quant.py``).
    calibrate_kv_scales: bool = False
    # Hybrid KV cache only: the metadata of groups 1, 2, ... (same queries and lengths, own slots and tables).
    kv_groups: tuple[AttentionMetadata, ...] = ()
    # Which KV group this metadata describes (backends that plan per step keep one plan per group).
    kv_group: int = 0
    # The step runs as one compiled graph (``execution/cpu_decode_compile.py``): decode rows only, full attention,
    # attended with tensor operations alone (``gathered_decode.py``): no host lists, no per-step plans, and no cache
    # writes: each layer appends its new (K, V) to ``new_kv``, which the caller stores after the graph.
    compiled_decode: bool = False
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # A compiled step of the deterministic mode (``gathered_invariant.py``): every token is a row, and this is, per
    # row, the position of the first key this step computes for the row's sequence (earlier keys are in the cache).
    fresh_from: torch.Tensor | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV group ``group`` (0: this one)."""
        return self if group == 0 else self.kv_groups[group - 1]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
