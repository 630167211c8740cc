"""Triton dequant-GEMM for INT4 weights: ``out = x @ dequant(qweight)`` without ever writing the
float weight to memory.

Each program owns a ``BLOCK_M x BLOCK_N`` output tile and walks the inputs in ``BLOCK_K`` steps:
it loads the packed int32 words covering those input rows (``k // 8``; eight neighbouring rows
share a word, so the load hits the same cache line), shifts out each row's nibble, subtracts the
row group's zero point and multiplies by its scale, then accumulates ``tl.dot`` in fp32. The
group of a row is ``k // group_size``, or ``g_idx[k]`` for GPTQ act-order (a gather per row:
slower, but exact). Layout conventions are those of ``int4_formats.py``.

Like the attention kernels, the launcher takes CUDA tensors (compiled) or, with
``TRITON_INTERPRET=1`` set before triton is first imported, CPU tensors (the unit tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_om,
    stride_on,
    HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(
            qweight_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :] * stride_qn, mask=kn_mask, other=0
        )
        # Arithmetic shift of a negative word drags ones in from the left; the mask drops them.
        q = (packed >> ((offs_k[:, None] % 8) * 4)) & 0xF
        if HAS_G_IDX:
            group = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
        else:
            group = offs_k // group_size
        scale = tl.load(scales_ptr + group[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0.0)
        zero = tl.load(zeros_ptr + group[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=kn_mask, other=0)
        w = (q.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype))
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _block_m(m: int) -> int:
    # tl.dot needs at least 16 rows; decode batches are small, prefills large.
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight [K/8, N]) -> [M, N]`` in ``x``'s dtype (see ``int4_formats``)."""
    if x.dim() != 2:
        raise ValueError(f"int4_matmul expects a 2-D input, got shape {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"input has {k} features but qweight packs {qweight.shape[0] * 8}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k = _block_m(m), 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        g_idx if g_idx is not None else qweight,  # never read without HAS_G_IDX
        out,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_G_IDX=g_idx is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
