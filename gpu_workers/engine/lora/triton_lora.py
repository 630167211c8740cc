"""Triton kernels for the batched multi-LoRA delta, segment style (SGMV): shrink, then expand.

A LoRA segment is a run of consecutive tokens of one adapter slot (``LoRABatch``; base-model tokens
belong to no segment and are never touched). Both kernels have one program per
``(segment, BLOCK_M tokens of it[, BLOCK_N outputs])``, so a program reads one slot's weights:

* shrink: ``h[t, :R] = scale[s] * x[t] @ a[s]^T`` into an fp32 scratch ``[T, R]`` (rows of base tokens
  stay unwritten and are never read);
* expand: ``y[t, n] += h[t] @ b[s, n]^T`` on the ``out`` columns of ``y`` (a strided slice of a merged
  projection's output is fine).

Segments cover disjoint tokens, so no two programs write the same ``y`` element: no atomics. Grids come
from host ints precomputed in ``LoRABatch``; no device-to-host sync. Launchers take CUDA tensors
(compiled) or, with ``TRITON_INTERPRET=1`` set before triton is first imported, CPU tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from .batch import LoRABatch

# tl.dot needs every dimension >= 16.
_BLOCK_M = 16
_MIN_BLOCK = 16
_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    scales_ptr,
    h_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_slots_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ht,
    stride_hr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    n = tl.load(seg_lens_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Programs past the segment's end (the grid is sized by the longest segment) are fully masked, and so
    # are base-model segments (slot -1): padded per-token metadata, as a CUDA graph would replay, is valid.
    row_mask = rows < tl.where(slot >= 0, n, 0)
    slot = tl.maximum(slot, 0)
    tokens = (start + rows).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xt = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # a[s] is [R, K]; load it transposed, [BLOCK_K, BLOCK_R].
        at = tl.load(
            a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None] * stride_ak,
            mask=k_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=PRECISION)
    acc *= tl.load(scales_ptr + slot)  # slot was clamped to 0 for base segments; their rows are masked
    tl.store(
        h_ptr + tokens[:, None] * stride_ht + ranks[None, :] * stride_hr,
        acc,
        mask=row_mask[:, None] & rank_mask[None, :],
    )


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_slots_ptr,
    N,
    R,
    stride_ht,
    stride_hr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_yt,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    n = tl.load(seg_lens_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.where(slot >= 0, n, 0)
    slot = tl.maximum(slot, 0)
    tokens = (start + rows).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    h = tl.load(
        h_ptr + tokens[:, None] * stride_ht + ranks[None, :] * stride_hr,
        mask=row_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    # b[s] is [N, R]; load it transposed, [BLOCK_R, BLOCK_N].
    bt = tl.load(
        b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
        mask=rank_mask[:, None] & col_mask[None, :],
        other=0.0,
    )
    # h is rounded to the weights' dtype, as the torch path rounds it to x's: fp32 accumulate either way.
    delta = tl.dot(h.to(bt.dtype).to(DOT_DTYPE), bt.to(DOT_DTYPE), input_precision=PRECISION)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + cols[None, :] * stride_yn
    y_mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_mask)


# True when the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 before
# triton's first import): triton.jit then returns an interpreter function, not a JITFunction.
INTERPRETED: bool = not isinstance(_shrink_kernel, triton.runtime.jit.JITFunction)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of the tl.dot calls: the weights' dtype, except that Triton's interpreter multiplies
    bfloat16 operands as their raw uint16 storage, so interpreted bf16 runs feed float32 values (already
    rounded to bf16, so the products are unchanged)."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRETED else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def add_lora_triton(ys: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                    batch: LoRABatch) -> None:  # fmt: skip
    """``ys [T, out]`` (a column slice of y) ``+=`` the LoRA delta of every segment; shapes checked by the caller."""
    num_segs = batch.num_segments
    if num_segs == 0:
        return
    rank, in_features = a.shape[1], a.shape[2]
    out = b.shape[1]
    block_r = max(_MIN_BLOCK, triton.next_power_of_2(rank))
    m_blocks = triton.cdiv(batch.max_seg_len, _BLOCK_M)
    # fp32 stacks keep fp32 products (tf32 would cost ~1e-3 relative); other dtypes use the tensor cores' native dot.
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    dot_dtype = _dot_dtype(a.dtype)
    h = torch.empty((batch.num_tokens, rank), dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_segs, m_blocks)](
        x, a, scales, h, batch.seg_starts, batch.seg_lens, batch.seg_slots,
        in_features, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, PRECISION=precision, DOT_DTYPE=dot_dtype,
    )  # fmt: skip
    _expand_kernel[(num_segs, m_blocks, triton.cdiv(out, _BLOCK_N))](
        h, b, ys, batch.seg_starts, batch.seg_lens, batch.seg_slots,
        out, rank,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), ys.stride(0), ys.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=block_r, PRECISION=precision, DOT_DTYPE=dot_dtype,
    )  # fmt: skip
