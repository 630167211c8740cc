"""Batched multi-LoRA delta: ``y[t] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T`` for the slot ``s`` of each token.

One step's flat batch may mix sequences of several adapters and of the base model (slot ``-1``).
:class:`LoRABatch` (``batch.py``) is built once per step by the model runner from the per-sequence runs and
holds everything the per-layer calls need, precomputed, so :func:`add_lora` does no host work beyond a few
attribute reads. Adapter weights are slot-stacked per projection slice: ``a [S, R, in]`` and
``b [S, out, R]`` with every adapter's rank zero-padded to ``R``; padded rows/columns are zeros, so
they add nothing.

A decode CUDA graph replays one fixed batch shape, so it uses :meth:`LoRABatch.per_row`: one segment per row of a
padded decode batch, reading each row's slot from a device buffer the runner rewrites before every replay (-1 for
base-model and padding rows, which every path masks). Nothing in it depends on which adapters a step uses.

Dispatch: the Triton kernels (``triton_lora.py``, segment style) on CUDA tensors, or on CPU tensors
under Triton's interpreter when :data:`TRITON_ON_CPU` is set (the unit tests); the torch path
everywhere else. The torch path has two strategies, chosen per step in :meth:`LoRABatch.from_runs`:

* gather (decode-like batches, short segments): gather each token's ``A``/``B`` and run two batched
  matrix-vector products, a fixed handful of ops whatever the number of distinct adapters;
* segments (prefill-like batches, long runs of one adapter): one ``mm`` + ``addmm_`` per segment on
  contiguous slices, which never copies weights per token.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .batch import LoRABatch

# Set (or export SLUICEGATE_LORA_TRITON_CPU=1) to run the Triton kernels on CPU tensors; only useful
# with TRITON_INTERPRET=1 set before triton's first import (the tests' conftest does that).
TRITON_ON_CPU: bool = os.environ.get("SLUICEGATE_LORA_TRITON_CPU", "") == "1"


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
           batch: LoRABatch, out_offset: int) -> None:  # fmt: skip
    """Shape checks on python ints only (no device sync): a wrong stack must fail loudly, not read garbage."""
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3 or scales.dim() != 1:
        raise ValueError(
            f"add_lora wants x [T, in], y [T, out_total], a [S, R, in], b [S, out, R], scales [S]; got "
            f"x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    num_slots, rank, in_features = a.shape
    out = b.shape[1]
    if x.shape[0] != batch.num_tokens or y.shape[0] != batch.num_tokens:
        raise ValueError(f"add_lora: x has {x.shape[0]} and y {y.shape[0]} rows, the batch {batch.num_tokens} tokens")
    if x.shape[1] != in_features or b.shape != (num_slots, out, rank) or scales.shape[0] != num_slots:
        raise ValueError(
            f"add_lora: inconsistent stacks x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    if out_offset < 0 or out_offset + out > y.shape[1]:
        raise ValueError(f"add_lora: out_offset {out_offset} + out {out} exceeds y's {y.shape[1]} columns")
    if batch.max_slot >= num_slots:
        raise ValueError(f"add_lora: the batch uses slot {batch.max_slot} but the stacks hold {num_slots} slots")


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
             batch: LoRABatch, *, out_offset: int = 0) -> None:  # fmt: skip
    """In place: ``y[t, out_offset:out_offset+out] += scales[s] * (x[t] @ a[s].T) @ b[s].T`` for every token
    ``t`` whose slot ``s >= 0``.

    x ``[T, in]``; a ``[S, R, in]`` (slot-stacked A, rank zero-padded to R = max_lora_rank); b ``[S, out, R]``;
    scales ``[S]`` float32 (alpha/r per slot, 0 for an empty slot); y ``[T, out_total]`` of x's dtype, or of a
    narrower one (a bf16 model's output with float32 adapters on a CPU): the delta is then computed in x's dtype and
    rounded once onto y, on the torch paths.
    """
    if not batch.has_lora:
        return
    _check(y, x, a, b, scales, batch, out_offset)
    ys = y.narrow(1, out_offset, b.shape[1])
    if (x.is_cuda or TRITON_ON_CPU) and y.dtype == x.dtype:
        triton_add = _triton_add_lora()
        if triton_add is not None:
            triton_add(ys, x, a, b, scales, batch)
            return
    if batch.use_segments and not batch.slots_on_device:
        _add_lora_segments(ys, x, a, b, scales, batch)
    else:
        _add_lora_gather(ys, x, a, b, scales, batch)


_Launcher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoRABatch], None]
_TRITON_ADD: _Launcher | None = None
_TRITON_TRIED = False


def _triton_add_lora() -> _Launcher | None:
    """The Triton launcher, imported on first use: the torch path must work without triton installed."""
    global _TRITON_ADD, _TRITON_TRIED
    if not _TRITON_TRIED:
        _TRITON_TRIED = True
        try:
            from .triton_lora import add_lora_triton
        except ImportError:
            _TRITON_ADD = None
        else:
            _TRITON_ADD = add_lora_triton
    return _TRITON_ADD


def _add_lora_gather(ys: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                     batch: LoRABatch) -> None:  # fmt: skip
    """Per-token gathered weights, two batched matrix-vector products: a fixed number of ops per call."""
    all_lora = batch.num_lora_tokens == batch.num_tokens
    slots = batch.lora_slots
    row_scales: torch.Tensor | None = None
    if batch.slots_on_device:  # rows of slot -1 read slot 0's weights, scaled by zero
        valid = slots >= 0
        slots = slots.clamp(min=0)
        row_scales = scales.index_select(0, slots) * valid
    xl = x if all_lora else x.index_select(0, batch.lora_tokens)
    # [L, 1, in] @ [L, in, R]: the row-vector orientation is the one CPU bmm kernels run fast.
    h = torch.bmm(xl.unsqueeze(1), a.index_select(0, slots).transpose(1, 2))
    # Scale in fp32 (the opmath of the in-place mul), rounded once to x's dtype.
    h.mul_((row_scales if row_scales is not None else scales.index_select(0, slots)).view(-1, 1, 1))
    delta = torch.bmm(b.index_select(0, slots), h.transpose(1, 2)).squeeze(2)
    if all_lora:
        ys.add_(delta)
    else:
        ys.index_add_(0, batch.lora_tokens, delta.to(ys.dtype))


def _add_lora_segments(ys: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                       batch: LoRABatch) -> None:  # fmt: skip
    """One ``mm`` + ``addmm_`` per LoRA segment on contiguous token slices (no weight copies)."""
    for start, n, slot in zip(batch.seg_starts_list, batch.seg_lens_list, batch.seg_slots_list, strict=True):
        h = x[start : start + n] @ a[slot].T
        h.mul_(scales[slot])
        if ys.dtype == h.dtype:
            ys[start : start + n].addmm_(h, b[slot].T)
        else:
            ys[start : start + n].add_(h @ b[slot].T)
