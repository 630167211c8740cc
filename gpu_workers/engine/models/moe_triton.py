"""Fused mixture-of-experts on Triton: each projection is one grouped-GEMM launch over every expert.

The ``tokens x top_k`` routing slots are laid out sorted by expert, each expert's run padded to a multiple of
``BLOCK_M`` rows (``align_by_expert``), so every ``BLOCK_M``-row block belongs to one expert and a program reads
one expert's weights. Two kernels:

* gate/up: ``h[r] = silu(x[token(r)] @ Wg[e]^T) * (x[token(r)] @ Wu[e]^T)``, the gate and up tiles of one
  program accumulated side by side from the same ``x`` tile (gate and up fused, and the activation in the
  epilogue), written in the padded sorted layout ``[capacity, I]``;
* down: ``y[slot(r)] = weight(slot) * (h[r] @ Wd[e]^T)``, written back in slot order ``[T * top_k, H]``, so a
  token's ``top_k`` rows are summed by a reshape: no atomics, no scatter.

The layout is computed on the device with static sizes (capacity ``T*k + min(E, T*k) * (BLOCK_M - 1)`` rows; blocks
past the last expert's run exit at once): no device-to-host sync, so a CUDA graph can capture the whole block.
Launchers take CUDA tensors (compiled) or, with ``TRITON_INTERPRET=1`` set before triton is first imported, CPU
tensors (Triton's interpreter, used by the unit tests against ``moe.experts_torch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.dot needs every dimension >= 16.
BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _block_tile(slots_ptr, num_slots, num_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's rows of the sorted layout, the slot of each (real unless it is padding, which carries
    ``num_slots``), and its output columns (those below ``num_cols`` real)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, slot, slot < num_slots, cols, cols < num_cols


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, slots_ptr, block_expert_ptr,
    num_slots, top_k, hidden, inter,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hr, stride_hn,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= NUM_EXPERTS:  # a block past the last expert's run: nothing to do
        return
    rows, slot, row_ok, cols, col_ok = _block_tile(slots_ptr, num_slots, inter, BLOCK_M, BLOCK_N)
    token = tl.where(row_ok, slot // top_k, 0)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + ks[None, :] * stride_xh,
            mask=row_ok[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter) * stride_wn + ks[:, None] * stride_wh, mask=w_mask, other=0.0)
        a = a.to(DOT_DTYPE)
        acc_gate = tl.dot(a, w_gate.to(DOT_DTYPE), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, w_up.to(DOT_DTYPE), acc_up, input_precision=PRECISION)
    # Gate and up rounded to the model's dtype first, as the torch path's matmul output is.
    out_dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(out_dtype).to(tl.float32)
    up = acc_up.to(out_dtype).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows[:, None] * stride_hr + cols[None, :] * stride_hn, h.to(out_dtype), mask=col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, slots_ptr, block_expert_ptr, weights_ptr,
    num_slots, hidden, inter,
    stride_hr, stride_hn, stride_we, stride_wh, stride_wn, stride_ys, stride_yh,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= NUM_EXPERTS:
        return
    rows, slot, row_ok, cols, col_ok = _block_tile(slots_ptr, num_slots, hidden, BLOCK_M, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + rows[:, None] * stride_hr + ks[None, :] * stride_hn, mask=k_ok[None, :], other=0.0)
        w = tl.load(
            w_base + cols[None, :] * stride_wh + ks[:, None] * stride_wn,
            mask=k_ok[:, None] & col_ok[None, :], other=0.0,
        )  # fmt: skip
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    out_dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slot, mask=row_ok, other=0.0)
    # Rounded to the model's dtype, then weighted in float32: the torch path's order.
    y = acc.to(out_dtype).to(tl.float32) * weight[:, None]
    y_ptrs = y_ptr + slot[:, None] * stride_ys + cols[None, :] * stride_yh
    tl.store(y_ptrs, y.to(out_dtype), mask=row_ok[:, None] & col_ok[None, :])


# True when the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 before
# triton's first import): triton.jit then returns an interpreter function, not a JITFunction.
INTERPRETED: bool = not isinstance(_down_kernel, triton.runtime.jit.JITFunction)


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of the tl.dot calls: the weights' own, except that Triton's interpreter multiplies bfloat16
    operands as their raw uint16 storage, so interpreted bf16 runs feed float32 (the same values)."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRETED else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing slots of ``ids [T, k]`` sorted by expert, each expert's run padded to ``block_m`` rows.

    Returns ``slots`` (int32 ``[capacity]``: the flat slot ``t * k + j`` of each row, ``T * k`` on padding rows)
    and ``block_expert`` (int32 ``[capacity // block_m]``: each block's expert, ``num_experts`` past the last run).
    Static sizes and device ops only: no host sync."""
    flat = ids.reshape(-1)
    num_slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_slots, device=ids.device) - start[expert_of]
    dest = padded_end[expert_of] - padded[expert_of] + rank
    capacity = -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m) * block_m
    slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=ids.device)
    slots[dest] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return slots, block_expert


def experts_triton(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """What ``moe.experts_torch`` computes, in two grouped-GEMM launches: ``x [T, H]``, ``gate_up [E, 2I, H]``,
    ``down [E, H, I]``, routing ``weights [T, k]`` (float32) and expert ``ids [T, k]``."""
    if x.device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "Triton kernels need CUDA tensors; CPU tensors run only under Triton's interpreter "
            "(set TRITON_INTERPRET=1 before triton is first imported in the process)"
        )
    num_tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    if gate_up.shape != (num_experts, 2 * inter, hidden) or down.shape[1] != hidden:
        raise ValueError(f"expert weights {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit hidden={hidden}")
    top_k = ids.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    slots, block_expert = align_by_expert(ids, num_experts)
    num_blocks = block_expert.numel()
    # fp32 weights keep fp32 products (tf32 would cost ~1e-3 relative); other dtypes use the tensor cores.
    precision = "ieee" if gate_up.dtype == torch.float32 else "tf32"
    dot_dtype = _dot_dtype(gate_up.dtype)
    h = torch.empty((slots.numel(), inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, _BLOCK_N))](
        x, gate_up, h, slots, block_expert,
        num_slots, top_k, hidden, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), h.stride(0), h.stride(1),
        NUM_EXPERTS=num_experts, BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        PRECISION=precision, DOT_DTYPE=dot_dtype,
    )  # fmt: skip
    y = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, _BLOCK_N))](
        h, down, y, slots, block_expert, flat_weights,
        num_slots, hidden, inter,
        h.stride(0), h.stride(1), down.stride(0), down.stride(1), down.stride(2), y.stride(0), y.stride(1),
        NUM_EXPERTS=num_experts, BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        PRECISION=precision, DOT_DTYPE=dot_dtype,
    )  # fmt: skip
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
