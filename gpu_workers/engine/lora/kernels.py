"""Batched multi-LoRA delta: ``y[t] += scale[s] * (x[t] @ A[s]^T) @ B[s]^T`` for the slot ``s`` of each token.

One step's flat batch may mix sequences of several adapters and of the base model (slot ``-1``).
:class:`LoRABatch` is built once per step by the model runner from the per-sequence runs and holds
everything the per-layer calls need, precomputed, so :func:`add_lora` does no host work beyond a few
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
from dataclasses import dataclass

import torch

# Set (or export SLUICEGATE_LORA_TRITON_CPU=1) to run the Triton kernels on CPU tensors; only useful
# with TRITON_INTERPRET=1 set before triton's first import (the tests' conftest does that).
TRITON_ON_CPU: bool = os.environ.get("SLUICEGATE_LORA_TRITON_CPU", "") == "1"

# The torch path takes the per-segment strategy when LoRA segments average at least this many tokens.
# Below it, per-segment op overhead (two matmuls per segment) exceeds the cost of gathering per-token
# weights; measured with benchmarks/lora_kernels.py on SmolLM2-135M's shapes (see the report there).
SEGMENT_MIN_AVG_TOKENS = 8


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each token of a flat step batch uses; built once per step by the model runner.

    ``token_slots`` is the per-token map (-1 = base model). The rest is derived metadata:
    LoRA segments (maximal runs of tokens of one slot >= 0; base runs are dropped) as device tensors
    for the Triton kernels and python tuples for the torch path, and the gather path's indices.
    """

    token_slots: torch.Tensor  # [T] int64, -1 = base model
    num_tokens: int
    # LoRA segments, in token order (int32 device tensors for Triton, tuples for the torch loop).
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    seg_starts_list: tuple[int, ...]
    seg_lens_list: tuple[int, ...]
    seg_slots_list: tuple[int, ...]
    max_seg_len: int
    # Gather path: the tokens that use an adapter and their slots ([L] int64 device tensors).
    lora_tokens: torch.Tensor
    lora_slots: torch.Tensor
    num_lora_tokens: int
    max_slot: int  # -1 when no token uses an adapter, or when unknown on the host (``per_row``)
    use_segments: bool  # the torch path's strategy for this step
    # ``per_row``: the slots live only in device memory and may be -1 (base or padding row), so the host lists
    # hold no slots and every row counts as an adapter token (the gather path masks the -1 rows).
    slots_on_device: bool = False

    @property
    def num_segments(self) -> int:
        """Segments the Triton kernels' grid covers (host int)."""
        return len(self.seg_lens_list)

    @classmethod
    def per_row(cls, slots: torch.Tensor, starts: torch.Tensor, ones: torch.Tensor) -> LoRABatch:
        """A decode batch of ``len(slots)`` one-token rows whose adapter slots are read from ``slots`` (int32 device
        tensor, -1 = base model) when the kernels run, not when the batch is built: the form a CUDA graph captures
        once and replays with new slots. ``starts`` must hold ``0..len(slots)-1`` and ``ones`` ones (int32, as long)."""
        rows = slots.shape[0]
        if starts.shape[0] != rows or ones.shape[0] != rows:
            raise ValueError(f"per-row LoRA batch: {rows} slots, {starts.shape[0]} starts, {ones.shape[0]} lengths")
        return cls(
            token_slots=slots,
            num_tokens=rows,
            seg_starts=starts,
            seg_lens=ones,
            seg_slots=slots,
            seg_starts_list=tuple(range(rows)),
            seg_lens_list=(1,) * rows,
            seg_slots_list=(),
            max_seg_len=1,
            lora_tokens=starts,
            lora_slots=slots,
            num_lora_tokens=rows,
            max_slot=-1,
            use_segments=False,
            slots_on_device=True,
        )

    @classmethod
    def from_runs(cls, runs: list[tuple[int, int]], device: torch.device | str) -> LoRABatch:
        """``runs`` = ``(slot, num_tokens)`` per sequence in the step's token order (a sequence's tokens are
        contiguous); slot -1 = base model. Consecutive runs of one slot merge into one segment."""
        device = torch.device(device)
        starts: list[int] = []
        lens: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        lora_tokens: list[int] = []
        lora_slots: list[int] = []
        pos = 0
        for slot, n in runs:
            if n <= 0:
                raise ValueError(f"LoRA run of {n} tokens (slot {slot}): every sequence contributes at least one")
            if slot < -1:
                raise ValueError(f"LoRA slot {slot}: slots are >= 0, or -1 for the base model")
            if slot >= 0:
                if slots and slots[-1] == slot and starts[-1] + lens[-1] == pos:
                    lens[-1] += n
                else:
                    starts.append(pos)
                    lens.append(n)
                    slots.append(slot)
                lora_tokens.extend(range(pos, pos + n))
                lora_slots.extend([slot] * n)
            token_slots.extend([slot] * n)
            pos += n

        def dev(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        num_lora = len(lora_tokens)
        return cls(
            token_slots=dev(token_slots, torch.int64),
            num_tokens=pos,
            seg_starts=dev(starts, torch.int32),
            seg_lens=dev(lens, torch.int32),
            seg_slots=dev(slots, torch.int32),
            seg_starts_list=tuple(starts),
            seg_lens_list=tuple(lens),
            seg_slots_list=tuple(slots),
            max_seg_len=max(lens, default=0),
            lora_tokens=dev(lora_tokens, torch.int64),
            lora_slots=dev(lora_slots, torch.int64),
            num_lora_tokens=num_lora,
            max_slot=max(slots, default=-1),
            use_segments=bool(slots) and num_lora >= SEGMENT_MIN_AVG_TOKENS * len(slots),
        )

    @property
    def has_lora(self) -> bool:
        """True when any token uses an adapter slot (otherwise :func:`add_lora` is a no-op)."""
        return self.num_lora_tokens > 0


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
