"""The deterministic mode on the GPU: batch-invariant Triton matmul, RMSNorm and paged attention.

On CUDA a row's numbers depend on its company wherever a kernel picks its strategy from the batch's shape: cuBLAS
chooses GEMV, split-K or another tile for a different row count, torch's row reduction splits a short batch's rows
across blocks, and the Triton attention's automatic split-KV count grows as the batch shrinks (``_auto_splits``).
Here every one of those is fixed (after "Defeating Nondeterminism in LLM Inference", as SGLang's deterministic and
vLLM's batch-invariant modes do):

- ``invariant_matmul``: one tile shape (``_BLOCK``) whatever the row count, no split-K: each output element sums
  its ``K`` products in the same tiles in the same order;
- ``invariant_rms_norm``: one program per row, the whole row in one block;
- ``invariant_paged_attention``: the attention kernel with one tile shape for prefill and decode alike, KV tiles
  on a grid of absolute positions and a FIXED split of the KV length (``split_tokens`` per segment), merged
  always: a query token's reduction order depends on its position only, so a prefill of N tokens gives the
  numbers of N decode steps. Segments past a token's context are empty and add exact zeros to the merge.

``make_batch_invariant_cuda`` switches a loaded model and its Triton attention backend over. Launchers take CUDA
tensors, or CPU tensors under Triton's interpreter (the unit tests' rehearsal).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import nn

from ..attention.metadata import AttentionMetadata
from ..attention.triton_kernels import (
    _check_device,
    _decode_block_m,
    _dot_dtype,
    _launch,
    _prepare,
    _scratch,
    merge_attn_states,
)
from .batch_invariant import shadow_forward

if TYPE_CHECKING:
    from ..attention.base import AttentionBackend

# One tile for every matmul: rows, columns and the reduction step. Fixed so that no row count changes a row's sums.
_BLOCK = (64, 64, 64)
# KV tokens per attention segment under the mode: fixed, so the number of segments a token's context falls into
# depends on its own length only (a multiple of every tile_n the kernel uses).
SPLIT_TOKENS = 512


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=(cols[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, N, eps, stride_x, stride_y, WEIGHT_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_OFFSET:  # Gemma: scale by 1 + weight, all in float32, rounded once
        y = normed * (1.0 + w)
    else:  # Llama: normalized rounded to x's dtype, then times the weight (as models/llama.py's RMSNorm)
        y = normed.to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``) with one tile shape for any number of rows."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {weight.shape[-1]}] and weight [N, K] expected; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype; got {x.dtype}, {weight.dtype}")
    flat = x.reshape(-1, x.shape[-1])
    (m, k), n = flat.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _check_device(flat, weight, y)
    if m and n:
        bm, bn, bk = _BLOCK
        _matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            flat, weight, bias if bias is not None else weight, y, m, n, k,
            *flat.stride(), *weight.stride(), *y.stride(),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=_dot_dtype(x.dtype),
            # float32 would otherwise multiply in TF32
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: bool = False) -> torch.Tensor:
    """RMSNorm of each row of ``x`` over its last dimension, one program per row."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x's last dimension {x.shape[-1]} != weight's {weight.shape[0]}")
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(flat)
    _check_device(flat, weight, y)
    if flat.shape[0]:
        _rms_norm_kernel[(flat.shape[0],)](
            flat, weight, y, flat.shape[1], eps, flat.stride(0), y.stride(0),
            WEIGHT_OFFSET=weight_offset, BLOCK_N=triton.next_power_of_2(flat.shape[1]),
        )  # fmt: skip
    return y.reshape(x.shape)


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    split_tokens: int = SPLIT_TOKENS,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``triton_kernels.paged_attention`` with every query token's result independent of the batch: one tile shape
    for prefill and decode, and the KV length cut into fixed ``split_tokens`` segments, merged always."""
    out, cfg = _prepare(q, k_cache, v_cache, meta, out, k_scale, v_scale)
    cfg = cfg.with_block_m(_decode_block_m(cfg.group))  # the smallest tile, for decode and prefill alike
    if split_tokens <= 0 or split_tokens % cfg.tile_n:
        raise ValueError(f"split_tokens must be a positive multiple of {cfg.tile_n}; got {split_tokens}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None; got {sliding_window}")
    num_tokens = q.shape[0]
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    # Bounded by the longest context (max_model_len in a CUDA graph): segments past a token's own are empty.
    splits = max(1, triton.cdiv(meta.max_seq_len, split_tokens))
    parts, parts_lse = _scratch(q, splits)
    grid_q = num_tokens // cfg.block_q + meta.num_seqs
    _launch(
        q, k_cache, v_cache, meta, scale, cfg, parts, parts_lse, grid_q, splits,
        kv_start=0, window=sliding_window, split_tiles=split_tokens // cfg.tile_n,
    )  # fmt: skip
    return merge_attn_states(parts, parts_lse, out, num_valid_tokens=meta.query_start_loc[-1:])


def _rms_norm_forward(module: nn.Module, x: torch.Tensor, *, weight_offset: bool) -> torch.Tensor:
    return invariant_rms_norm(x, module.weight, module.eps, weight_offset)


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant_matmul(x, module.weight, module.bias)


def make_batch_invariant_cuda(model: nn.Module, backend: AttentionBackend) -> int:
    """Switch a loaded model on the GPU and its Triton attention backend to batch-invariant execution; returns
    how many modules now run on this module's kernels. ``EngineConfig`` refuses what this cannot cover."""
    if not hasattr(backend, "batch_invariant") or backend.name != "triton":
        raise ValueError(f"the deterministic mode on the GPU needs the triton attention backend, not {backend.name!r}")
    from ..models.gemma3 import GemmaRMSNorm
    from ..models.llama import RMSNorm
    from ..models.moe import MoEExperts

    if any(isinstance(module, MoEExperts) for module in model.modules()):
        # The routed experts' grouped matmuls take each expert's share of the batch: another kernel to make invariant.
        raise ValueError("the deterministic mode on the GPU does not support mixture-of-experts models yet")
    backend.batch_invariant = True
    backend.attention = invariant_paged_attention  # type: ignore[attr-defined]  # the triton backend (checked above)

    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            shadow_forward(module, _linear_forward)
        elif type(module) in (RMSNorm, GemmaRMSNorm):
            shadow_forward(module, functools.partial(_rms_norm_forward, weight_offset=type(module) is GemmaRMSNorm))
        else:
            continue
        switched += 1
    return switched
