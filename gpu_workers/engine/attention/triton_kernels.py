"""Triton kernels for paged attention: writing new K/V rows into the paged cache, and one
FlashAttention-style kernel that attends a mixed batch of prefills and decodes over that cache.

Layout and batch conventions are those of ``metadata.py``. The attention kernel is "unified":
one launch covers every sequence of the step. Its grid is ``(query tiles, kv heads, kv splits)``.
A query tile holds ``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query
heads that share one KV head (GQA), flattened into ``BLOCK_M`` rows, so each K/V tile is read once
per group rather than once per query head. Programs locate their sequence by a binary search over
``query_start_loc``, so the launch needs no host-side index and no device-to-host sync (CUDA-graph
friendly). The KV context is walked in tiles of ``TILE_N`` tokens that are independent of the
cache's block size: each token position is translated to ``(block, offset)`` in the kernel.

For decode steps with few sequences and long contexts, the KV range of each program can be cut
into ``num_splits`` segments (flash-decoding); every segment writes a normalised partial output
and its log-sum-exp, and a merge kernel combines them. The same partial/merge machinery gives the
cascade path, :func:`cascade_paged_attention`, which attends all queries of a batch whose
sequences share a common prefix against that prefix once, then merges with each sequence's own
suffix attention.

Launchers accept CUDA tensors (compiled) or, with ``TRITON_INTERPRET=1`` set before triton is
first imported, CPU tensors (Triton's interpreter, used by the unit tests).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2

# Decode steps get split-KV only when the unsplit grid would leave the GPU mostly idle and each
# segment still has this many KV tiles of work (fewer makes the merge cost dominate).
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64
# Split-KV scratch is ``num_splits * num_tokens * num_heads * head_dim`` floats; above this many
# query tokens the grid is large enough without splitting.
_MAX_SPLIT_TOKENS = 512
# Heads merged per program by merge_attn_states (bounds the fp32 accumulator's registers).
_MERGE_BLOCK_H = 16


# --------------------------------------------------------------------------------------------
# KV cache write
# --------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_code(x):
    """fp32 values already clamped to +-448 -> their float8_e4m3fn byte (round to nearest, ties to
    even), by integer arithmetic on the fp32 bits alone.

    Why integers: float rounding tricks and the compiled fp32 -> fp8 conversion differ between
    Triton's interpreter (the CPU tests; it drops the carry into the exponent, 7.96 -> 4.0) and
    compiled code on a GPU, where the earlier float-based rounding was still off torch's cast for
    some values on an H100 (2026-11-26). Integer shifts and adds mean the same everywhere."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6, fp32 exponent field >= 121): keep 3 of the 23 mantissa bits, ties to
    # even; a carry out of the mantissa moves into the exponent, as rounding up should. Then
    # rebias the exponent from fp32's 127 to e4m3's 7: (127 - 7) << 3 = 960.
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) >> 20) - 960
    # Subnormal range: the code is |x| / 2^-9 rounded to an integer (0..8; 8 is the smallest normal,
    # whose code is also 8). |x| = significand * 2^(exponent - 150), so the code is the significand
    # shifted right by 141 - exponent, at least 21 here; past 31 the result is 0 either way.
    exponent = mag >> 23
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exponent, 31)
    quotient = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rest > half) | ((rest == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.int32)
    return (tl.where(mag >= 0x3C800000, normal, subnormal) | sign).to(tl.uint8)


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_size,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
):
    # FP8: the cache arrives as its uint8 view (store_kvcache); each row is divided by its KV head's
    # scale, saturated at +-448 and encoded to e4m3 bytes with ties to even (kv_quant.quantize_rows
    # is the torch twin, bit for bit).
    # The division is div_rn: compiled Triton's plain '/' on fp32 is the approximate div.full.f32
    # (up to 2 ulp off), which moved values across a rounding boundary on an H100 (2026-11-26 run).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        head_valid = heads < num_kv_heads
        mask = head_valid[:, None] & (dims[None, :] < HEAD_DIM)

        src_k = k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
        dst_k = k_cache_ptr + block * stride_kcb + offset * stride_kco
        dst_k += heads[:, None] * stride_kch + dims[None, :] * stride_kcd
        k = tl.load(src_k, mask=mask)
        if FP8:
            k_scale = tl.load(k_scale_ptr + heads, mask=head_valid, other=1.0)
            k = _e4m3_code(tl.clamp(tl.div_rn(k.to(tl.float32), k_scale[:, None]), -448.0, 448.0))
        tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

        src_v = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
        dst_v = v_cache_ptr + block * stride_vcb + offset * stride_vco
        dst_v += heads[:, None] * stride_vch + dims[None, :] * stride_vcd
        v = tl.load(src_v, mask=mask)
        if FP8:
            v_scale = tl.load(v_scale_ptr + heads, mask=head_valid, other=1.0)
            v = _e4m3_code(tl.clamp(tl.div_rn(v.to(tl.float32), v_scale[:, None]), -448.0, 448.0))
        tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# True when these kernels can run on CPU tensors through Triton's interpreter. ``triton.jit``
# picks interpreter or compiler from TRITON_INTERPRET when a function is defined, and
# triton.language's own jit helpers (tl.max, tl.sum, tl.cdiv...) are defined when triton is first
# imported: the variable must be set before that import, not merely before this module's.
_KERNELS_INTERPRETED = not isinstance(_store_kvcache_kernel, triton.runtime.jit.JITFunction)
INTERPRETED: bool = _KERNELS_INTERPRETED and not isinstance(tl.cdiv, triton.runtime.jit.JITFunction)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write row ``i`` of ``k``/``v`` (``[num_tokens, num_kv_heads, head_dim]``) into cache slot
    ``slot_mapping[i]`` of ``k_cache``/``v_cache`` (``[num_blocks, block_size, num_kv_heads,
    head_dim]``); rows whose slot is ``-1`` are skipped. Values are cast to the cache's dtype; a
    float8_e4m3fn cache needs ``k_scale``/``v_scale`` (fp32 ``[num_kv_heads]``) and stores
    ``x / scale`` saturated at +-448."""
    if k.dim() != 3 or v.shape != k.shape:
        shapes = f"{tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim]; got {shapes}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {k_cache.shape}, {v_cache.shape}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k rows {tuple(k.shape[1:])} do not match cache rows {tuple(k_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={k.shape[0]}]; got {tuple(slot_mapping.shape)}")
    _check_device(k, v, k_cache, v_cache, slot_mapping)
    fp8 = _check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if fp8:  # the kernel writes e4m3 bytes it encoded itself (_e4m3_code)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,  # placeholder pointers, never read without FP8
        v_scale if fp8 else slot_mapping,
        k_cache.shape[1],
        num_kv_heads,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        FP8=fp8,
    )


def _check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """True for a float8_e4m3fn cache whose ``[num_kv_heads]`` fp32 scales are given; raises when a
    float8 cache lacks them, they do not fit, or scales come with a cache that is not float8."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    given = [s for s in (k_scale, v_scale) if s is not None]
    if not fp8:
        if given:
            raise ValueError(f"k_scale/v_scale apply to a float8_e4m3fn KV cache only; this one is {k_cache.dtype}")
        if k_cache.dtype.itemsize == 1:
            raise ValueError(f"unsupported KV cache dtype {k_cache.dtype}; the 8-bit cache is float8_e4m3fn")
        return False
    if len(given) != 2:
        raise ValueError("a float8_e4m3fn KV cache needs both k_scale and v_scale")
    num_kv_heads = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert scale is not None
        if scale.shape != (num_kv_heads,) or scale.dtype != torch.float32 or not scale.is_contiguous():
            got = f"{scale.dtype} {tuple(scale.shape)}"
            raise ValueError(f"{name} must be contiguous float32 [num_kv_heads={num_kv_heads}]; got {got}")
        _check_device(k_cache, scale)
    return True


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Last sequence ``i`` whose first query tile slot ``query_start_loc[i] // BLOCK_Q + i`` is
    ``<= pid``. That slot numbering gives every sequence at least ``cdiv(q_len, BLOCK_Q)``
    consecutive program ids, so the grid size only needs host-known bounds."""
    # Annotated so both stay tensors even if num_seqs were specialised to a constant.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_slot = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_slot <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


# The ints here change from step to step; specialising on their values (== 1, multiple of 16)
# would only multiply the compiled variants (each a JIT compile in the serving path).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "kv_start", "prefix_len", "window"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    num_tokens,
    kv_start,
    prefix_len,
    prefix_len_ptr,
    window,
    k_scale_ptr,
    v_scale_ptr,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    stride_os,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_bts,
    stride_btb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DYNAMIC_PREFIX: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
):
    # SPLIT_TILES > 0 (the deterministic mode, batch_invariant_triton.py): KV tiles sit on a grid of absolute
    # positions (multiples of TILE_N) and split s covers tiles [s * SPLIT_TILES, (s + 1) * SPLIT_TILES), so a query
    # token's reduction order depends on its own position only, not on its tile's other tokens nor the batch.
    # SLIDING (MODES 0 and 1): query position p sees keys p - window < k <= p; the KV range starts at
    # the tile's first query's window, so blocks released behind every window are never read.
    # KV_FP8: the cache holds float8_e4m3fn with one scale per KV head (kv_quant.py). Tiles are only
    # cast to DOT_DTYPE; K's scale multiplies the scores and V's the output, once per program.
    # MODE 0: mixed batch (binary search for the sequence), causal.
    # MODE 1: decode-only batch, one program per sequence, causal.
    # MODE 2: shared-prefix pass of cascade attention: every query token of the batch attends,
    #         without a causal mask, to positions [0, prefix_len) of block table row 0.
    # DYNAMIC_PREFIX: the shared prefix length is read from prefix_len_ptr (CUDA graphs): it is
    # the prefix pass's prefix_len, and the suffix pass's kv_start.
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DYNAMIC_PREFIX:
        if MODE == 2:
            prefix_len = tl.load(prefix_len_ptr)
        else:
            kv_start = tl.load(prefix_len_ptr)

    if MODE == 2:
        seq_idx = 0
        q_start = 0
        q_len = num_tokens
        seq_len = prefix_len
        q_block = pid_q
    else:
        if MODE == 1:
            seq_idx = pid_q
        else:
            seq_idx = _find_seq(query_start_loc_ptr, num_seqs, pid_q, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq_idx)
        q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq_idx)
        if MODE == 1:
            q_block = 0
        else:
            q_block = pid_q - (q_start // BLOCK_Q + seq_idx)
    if q_block * BLOCK_Q >= q_len:
        return

    # Row r of the tile is query token r // GROUP of the tile and query head r % GROUP of the group.
    rows = tl.arange(0, BLOCK_M)
    tok_in_tile = rows // GROUP
    q_idx = q_block * BLOCK_Q + tok_in_tile
    row_valid = (tok_in_tile < BLOCK_Q) & (q_idx < q_len)
    head = kv_head * GROUP + rows % GROUP
    q_pos = seq_len - q_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(DOT_DTYPE)
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)

    # KV positions this tile needs: [kv_start, kv_end), where kv_end stops after the last query
    # position of the tile (causal), then this program's share of that range when split.
    if MODE == 2:
        kv_end = prefix_len
    else:
        kv_end = seq_len - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
        if SLIDING:
            kv_start = tl.maximum(kv_start, seq_len - q_len + q_block * BLOCK_Q - window + 1)
    if SPLIT_TILES > 0:
        kv_base = 0
        tile_lo = tl.maximum(split * SPLIT_TILES, kv_start // TILE_N)
        tile_hi = tl.minimum((split + 1) * SPLIT_TILES, tl.cdiv(kv_end, TILE_N))
    else:
        kv_base = kv_start
        num_tiles = tl.cdiv(tl.maximum(kv_end - kv_start, 0), TILE_N)
        tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_row = block_tables_ptr + seq_idx * stride_bts
    cols = tl.arange(0, TILE_N)

    for tile in range(tile_lo, tile_hi):
        pos = kv_base + tile * TILE_N + cols
        pos_valid = (pos < kv_end) & (pos >= kv_start)
        block = tl.load(block_row + (pos // block_size) * stride_btb, mask=pos_valid, other=0).to(tl.int64)
        offset = pos % block_size
        kv_mask = pos_valid[:, None] & dim_valid[None, :]

        k_ptrs = k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko + kv_head * stride_kh
        k = tl.load(k_ptrs + dims[None, :] * stride_kd, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale

        if MODE == 2:
            keep = pos_valid[None, :]
        else:
            keep = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if SLIDING:
                keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))

        # Online softmax in base 2; a row that has seen only masked keys keeps m = -inf, and the
        # shift by 0 then turns its -inf scores into zero weights instead of NaNs.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo + kv_head * stride_vh
        v = tl.load(v_ptrs + dims[None, :] * stride_vd, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        # P is rounded to the query dtype as on the tensor cores, whatever DOT_DTYPE is.
        p_dot = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr + kv_head)
    o_ptrs = out_ptr + split * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh
    o_mask = row_valid[:, None] & dim_valid[None, :]
    tl.store(o_ptrs + dims[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        # Natural-log LSE of the scaled scores; -inf for an empty segment so the merge ignores it.
        lse = tl.where(has_mass, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        lse_ptrs = lse_ptr + split * stride_ls + token * stride_lt + head * stride_lh
        tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_parts"])
def _merge_states_kernel(
    parts_ptr,
    parts_lse_ptr,
    out_ptr,
    out_lse_ptr,
    num_valid_ptr,
    num_parts,
    num_heads,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_od,
    stride_olt,
    stride_olh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    LIMIT_TOKENS: tl.constexpr,
):
    # One program merges BLOCK_H heads of one token: first the LSE maximum over all parts, then
    # a pass over the parts accumulating their weighted outputs.
    token = tl.program_id(0).to(tl.int64)
    if LIMIT_TOKENS:
        # Padding rows of the batch have no partial results to merge.
        if token >= tl.load(num_valid_ptr):
            return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_valid = heads < num_heads
    dim_valid = dims < HEAD_DIM

    lse_base = parts_lse_ptr + token * stride_lt
    all_lse = tl.load(
        lse_base + parts[:, None] * stride_ls + heads[None, :] * stride_lh,
        mask=(parts[:, None] < num_parts) & head_valid[None, :],
        other=float("-inf"),
    )
    lse_max = tl.max(all_lse, 0)
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    tile_mask = head_valid[:, None] & dim_valid[None, :]
    for part in range(num_parts):
        lse = tl.load(lse_base + part * stride_ls + heads * stride_lh, mask=head_valid, other=float("-inf"))
        weight = tl.exp(lse - shift)
        part_ptrs = parts_ptr + part * stride_ps + token * stride_pt + heads[:, None] * stride_ph
        o = tl.load(part_ptrs + dims[None, :] * stride_pd, mask=tile_mask, other=0.0)
        # An empty part (weight 0) may hold anything; where() keeps a 0 * x product out.
        acc += tl.where((weight > 0.0)[:, None], o * weight[:, None], 0.0)
        total += weight

    total_safe = tl.where(total > 0.0, total, 1.0)
    merged = acc / total_safe[:, None]
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=tile_mask)
    if WRITE_LSE:
        merged_lse = tl.where(total > 0.0, tl.log(total_safe) + shift, float("-inf"))
        tl.store(out_lse_ptr + token * stride_olt + heads * stride_olh, merged_lse, mask=head_valid)


def merge_attn_states(
    parts: torch.Tensor,
    parts_lse: torch.Tensor,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    *,
    num_valid_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine attention results over disjoint KV segments into attention over their union.

    ``parts`` is ``[num_parts, num_tokens, num_heads, head_dim]`` (each part normalised over its
    own segment) and ``parts_lse`` ``[num_parts, num_tokens, num_heads]`` the natural-log
    log-sum-exp of each part's scaled scores (``-inf`` for an empty segment). Writes and returns
    ``out`` (``[num_tokens, num_heads, head_dim]``, allocated in ``parts``' dtype if not given);
    fills ``out_lse`` (``[num_tokens, num_heads]`` float32) with the merged LSE when given.
    ``num_valid_tokens`` (a one-element integer tensor on the same device, e.g.
    ``query_start_loc[-1:]``) restricts the merge to the first that many tokens.
    """
    if parts.dim() != 4 or parts_lse.shape != parts.shape[:3]:
        raise ValueError(
            "parts must be [num_parts, num_tokens, num_heads, head_dim] and parts_lse "
            f"[num_parts, num_tokens, num_heads]; got {tuple(parts.shape)}, {tuple(parts_lse.shape)}"
        )
    num_parts, num_tokens, num_heads, head_dim = parts.shape
    if num_parts < 1:
        raise ValueError("merge_attn_states needs at least one part")
    if out is None:
        out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    elif out.shape != parts.shape[1:]:
        raise ValueError(f"out must be {tuple(parts.shape[1:])}; got {tuple(out.shape)}")
    if out_lse is not None and out_lse.shape != parts_lse.shape[1:]:
        raise ValueError(f"out_lse must be {tuple(parts_lse.shape[1:])}; got {tuple(out_lse.shape)}")
    extra = [t for t in (out_lse, num_valid_tokens) if t is not None]
    if num_valid_tokens is not None and num_valid_tokens.numel() != 1:
        raise ValueError(f"num_valid_tokens must hold one element; got shape {tuple(num_valid_tokens.shape)}")
    _check_device(parts, parts_lse, out, *extra)
    if num_tokens == 0 or num_heads == 0:
        return out
    lse_target = out_lse if out_lse is not None else parts_lse  # never written when WRITE_LSE is off
    block_h = min(triton.next_power_of_2(num_heads), _MERGE_BLOCK_H)
    _merge_states_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        parts,
        parts_lse,
        out,
        lse_target,
        num_valid_tokens if num_valid_tokens is not None else parts_lse,
        num_parts,
        num_heads,
        *parts.stride(),
        *parts_lse.stride(),
        *out.stride(),
        *lse_target.stride()[-2:],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_H=block_h,
        PARTS_PAD=triton.next_power_of_2(num_parts),
        WRITE_LSE=out_lse is not None,
        LIMIT_TOKENS=num_valid_tokens is not None,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token of ``meta``'s batch over its sequence's paged KV
    (only its last ``sliding_window`` positions, the query's own included, when given).

    ``q`` is ``[num_tokens, num_heads, head_dim]`` (any strides); ``num_heads`` must be a multiple
    of the cache's ``num_kv_heads``. Returns ``out`` (``[num_tokens, num_heads, head_dim]`` in
    ``q``'s dtype, allocated if not given). Rows past ``query_start_loc[-1]`` are left untouched.
    ``num_splits`` cuts each program's KV range into that many segments merged afterwards
    (flash-decoding); ``None`` picks it from the batch shape and the GPU. A float8_e4m3fn cache
    needs its per-KV-head ``k_scale``/``v_scale`` (as for :func:`store_kvcache`).
    """
    out, cfg = _prepare(q, k_cache, v_cache, meta, out, k_scale, v_scale)
    num_tokens = q.shape[0]
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    grid_q = _grid_q(meta, num_tokens, cfg)
    splits = num_splits if num_splits is not None else _auto_splits(q, meta, grid_q * cfg.num_kv_heads, cfg)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {splits}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None; got {sliding_window}")
    if splits == 1:
        _launch(q, k_cache, v_cache, meta, scale, cfg, out, None, grid_q, 1, kv_start=0, window=sliding_window)
        return out
    parts, parts_lse = _scratch(q, splits)
    _launch(q, k_cache, v_cache, meta, scale, cfg, parts, parts_lse, grid_q, splits, kv_start=0, window=sliding_window)
    return merge_attn_states(parts, parts_lse, out, num_valid_tokens=meta.query_start_loc[-1:])


def cascade_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    shared_prefix_len: int | torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = 1,
    prefix_splits: int | None = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as :func:`paged_attention` for a batch whose sequences all start with the same
    ``shared_prefix_len`` tokens stored in the same physical blocks, reading that prefix's KV once
    per query tile of the whole batch instead of once per sequence.

    Preconditions: ``shared_prefix_len`` is a positive multiple of the block size (checked); the
    first ``shared_prefix_len // block_size`` entries of every block table row are identical, and
    every sequence's cached context ``seq_len - q_len`` is at least ``shared_prefix_len`` (no query
    sits inside the prefix). The last two would need a device sync or a per-sequence loop per
    layer to check, so compute the length once per step with :func:`common_prefix_len`, which
    guarantees them. ``num_splits``/``prefix_splits`` split the suffix and prefix passes' KV
    ranges as in :func:`paged_attention` (``None``: picked from the batch shape and the GPU).

    ``shared_prefix_len`` may instead be a one-element int32 tensor on ``q``'s device that the
    kernels read when they run (CUDA graphs replay fixed launches while the length changes). Its
    value is then the caller's promise, unchecked: a multiple of the block size meeting the
    preconditions above, or 0, which leaves the prefix pass empty (plain paged attention).
    ``k_scale``/``v_scale``: a float8_e4m3fn cache's scales, as for :func:`paged_attention`.
    """
    out, cfg = _prepare(q, k_cache, v_cache, meta, out, k_scale, v_scale)
    block_size = k_cache.shape[1]
    prefix_device: torch.Tensor | None = None
    if isinstance(shared_prefix_len, torch.Tensor):
        prefix_device = shared_prefix_len
        if prefix_device.numel() != 1 or prefix_device.dtype != torch.int32:
            got = f"{prefix_device.dtype} {tuple(prefix_device.shape)}"
            raise ValueError(f"a tensor shared_prefix_len must be one int32 element; got {got}")
        _check_device(q, prefix_device)
        host_prefix = 0
    elif shared_prefix_len <= 0 or shared_prefix_len % block_size != 0:
        bad = shared_prefix_len
        raise ValueError(f"shared_prefix_len must be a positive multiple of block_size={block_size}; got {bad}")
    else:
        host_prefix = shared_prefix_len
    num_tokens = q.shape[0]
    # Shared prefix: all tokens of the batch form one query stream, so use the largest tile.
    prefix_cfg = cfg.with_block_m(_prefill_block_m(cfg.group))
    prefix_grid = triton.cdiv(num_tokens, prefix_cfg.block_q)
    suffix_grid = _grid_q(meta, num_tokens, cfg)
    if prefix_splits is None:
        # A device-side length is unknown here; the longest context bounds it.
        prefix_bound = host_prefix if prefix_device is None else meta.max_seq_len
        prefix_splits = _splits_for(q, prefix_bound, prefix_grid * cfg.num_kv_heads, prefix_cfg.tile_n)
    if num_splits is None:
        num_splits = _splits_for(q, meta.max_seq_len - host_prefix, suffix_grid * cfg.num_kv_heads, cfg.tile_n)
    if num_splits < 1 or prefix_splits < 1:
        raise ValueError(f"num_splits and prefix_splits must be >= 1; got {num_splits}, {prefix_splits}")
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    parts, parts_lse = _scratch(q, prefix_splits + num_splits)

    _launch(
        q,
        k_cache,
        v_cache,
        meta,
        scale,
        prefix_cfg,
        parts[:prefix_splits],
        parts_lse[:prefix_splits],
        prefix_grid,
        prefix_splits,
        kv_start=0,
        prefix_len=host_prefix,
        prefix_pass=True,
        prefix_len_device=prefix_device,
    )
    _launch(
        q,
        k_cache,
        v_cache,
        meta,
        scale,
        cfg,
        parts[prefix_splits:],
        parts_lse[prefix_splits:],
        suffix_grid,
        num_splits,
        kv_start=host_prefix,
        prefix_len_device=prefix_device,
    )
    return merge_attn_states(parts, parts_lse, out, num_valid_tokens=meta.query_start_loc[-1:])


def common_prefix_len(block_tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int) -> int:
    """Longest ``shared_prefix_len`` that :func:`cascade_paged_attention` may use for a batch:
    the whole blocks that every row of ``block_tables`` (host lists of physical block ids) starts
    with identically, capped by the shortest cached context (``context_lens[i] = seq_len_i -
    q_len_i``, rounded down to whole blocks). 0 for fewer than two sequences."""
    if len(block_tables) != len(context_lens):
        raise ValueError(f"{len(block_tables)} block table rows but {len(context_lens)} context lengths")
    if len(block_tables) < 2:
        return 0
    num_blocks = min(context_lens) // block_size
    first = block_tables[0]
    # Runs once per decode step over up to hundreds of rows: slice comparisons run in C, and a
    # row that differs only narrows the candidate length by a binary search over its prefix.
    for row in block_tables[1:]:
        if num_blocks == 0:
            break
        if row[:num_blocks] == first[:num_blocks]:
            continue
        lo, hi = 0, num_blocks - 1  # the shared length with this row lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if row[:mid] == first[:mid]:
                lo = mid
            else:
                hi = mid - 1
        num_blocks = lo
    return num_blocks * block_size


# --------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    """Shape-derived launch parameters shared by the attention launchers."""

    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    block_m: int  # rows per program: block_q tokens x group heads, a power of two >= 16
    decode_only: bool
    fp32: bool = False  # float32 operands: twice the registers per tile element
    # A float8_e4m3fn cache's (k_scale, v_scale), each [num_kv_heads] fp32; None for other caches.
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)

    @property
    def num_warps(self) -> int:
        # At 4 warps, tiles of 64x256 bf16 (or 128x128, or 64x128 fp32) spill registers on sm_90
        # (ptxas: 255 regs plus local-memory stack); 8 warps hold them without spilling.
        tile_bytes = self.block_m * self.head_dim_pad * (4 if self.fp32 else 2)
        return 8 if tile_bytes >= 64 * 256 * 2 else 4

    @property
    def head_dim_pad(self) -> int:
        return max(16, triton.next_power_of_2(self.head_dim))

    @property
    def block_q(self) -> int:
        return self.block_m // self.group

    @property
    def tile_n(self) -> int:
        # KV tokens per inner-loop step, independent of the cache's block size. float32's IEEE
        # dots run on FMA units and hold far more in registers: with full tiles, the 8-warp
        # (prefill-sized) programs put 10-17 KiB per thread in local memory on sm_90, which CUDA
        # reserves for every resident thread of the GPU; half tiles cut it below 1 KiB (d <= 128).
        tile = 64 if self.head_dim_pad <= 128 else 32
        return tile // 2 if self.fp32 and self.num_warps == 8 else tile

    def with_block_m(self, block_m: int) -> _Config:
        return replace(self, block_m=block_m, decode_only=False)


def _prefill_block_m(group: int) -> int:
    return max(64, triton.next_power_of_2(group))


def _decode_block_m(group: int) -> int:
    # tl.dot needs at least 16 rows; the GQA group fills them instead of padding.
    return max(16, triton.next_power_of_2(group))


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; got {device} and {t.device}")
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "Triton kernels need CUDA tensors; CPU tensors run only under Triton's interpreter "
            "(set TRITON_INTERPRET=1 before triton is first imported in the process)"
        )


def _prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, _Config]:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim]; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if meta.query_start_loc.shape[0] != meta.num_seqs + 1 or meta.block_tables.shape[0] != meta.num_seqs:
        raise ValueError(
            f"metadata disagrees on num_seqs: seq_lens {meta.num_seqs}, query_start_loc "
            f"{meta.query_start_loc.shape[0]} (want num_seqs + 1), block_tables {meta.block_tables.shape[0]}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype must be float16, bfloat16 or float32; got {q.dtype}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}; got {tuple(out.shape)}")
    _check_device(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype}, {v_cache.dtype}")
    kv_scales = None
    if _check_kv_scales(k_cache, k_scale, v_scale) and k_scale is not None and v_scale is not None:
        kv_scales = (k_scale, v_scale)
    group = num_heads // num_kv_heads
    decode_only = meta.max_query_len <= 1
    block_m = _decode_block_m(group) if decode_only else _prefill_block_m(group)
    fp32 = q.dtype == torch.float32
    return out, _Config(num_kv_heads, group, head_dim, block_m, decode_only, fp32=fp32, kv_scales=kv_scales)


def _grid_q(meta: AttentionMetadata, num_tokens: int, cfg: _Config) -> int:
    if cfg.decode_only:
        return meta.num_seqs
    # Upper bound of the slot numbering used by _find_seq; surplus programs exit at once.
    return num_tokens // cfg.block_q + meta.num_seqs


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_splits(q: torch.Tensor, meta: AttentionMetadata, programs: int, cfg: _Config) -> int:
    return _splits_for(q, meta.max_seq_len, programs, cfg.tile_n)


def _splits_for(q: torch.Tensor, kv_len: int, programs: int, tile_n: int) -> int:
    """KV splits for a launch of ``programs`` programs over up to ``kv_len`` keys each."""
    if q.device.type != "cuda" or q.shape[0] > _MAX_SPLIT_TOKENS:
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    by_occupancy = triton.cdiv(2 * sms, max(programs, 1))
    by_length = triton.cdiv(max(kv_len, 0), tile_n) // _MIN_TILES_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of the kernel's tl.dot calls: the query dtype, except that Triton's
    interpreter multiplies bfloat16 operands as their raw uint16 storage, so interpreted bf16
    runs feed the dots float32 values (already rounded to bf16, so the result is unchanged)."""
    if dtype == torch.bfloat16:
        return tl.float32 if _KERNELS_INTERPRETED else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def _scratch(q: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    parts = torch.empty((num_parts, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
    parts_lse = torch.empty((num_parts, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    return parts, parts_lse


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    cfg: _Config,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    grid_q: int,
    num_splits: int,
    *,
    kv_start: int,
    prefix_len: int = 0,
    prefix_pass: bool = False,
    prefix_len_device: torch.Tensor | None = None,
    window: int | None = None,
    split_tiles: int = 0,
) -> None:
    """One attention launch; ``out``/``lse`` are ``[splits, tokens, heads, (dim)]`` when ``lse`` is
    given (partial results for a merge), else ``out`` is the final ``[tokens, heads, dim]``.
    ``prefix_pass`` runs cascade's shared-prefix pass over ``[0, prefix_len)``; with
    ``prefix_len_device`` the kernel reads that length (prefix pass) or ``kv_start`` (suffix pass)
    from the tensor instead."""
    if lse is not None:
        out_strides = out.stride()
        lse_strides = lse.stride()
        lse_target = lse
    else:
        out_strides = (0, *out.stride())
        lse_strides = (0, 0, 0)
        lse_target = out  # placeholder pointer, never written with WRITE_LSE off
    if prefix_pass:
        mode = 2
    elif cfg.decode_only:
        mode = 1
    else:
        mode = 0
    _paged_attention_kernel[(grid_q, cfg.num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        lse_target,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale * _LOG2E,
        meta.num_seqs,
        q.shape[0],
        kv_start,
        prefix_len,
        prefix_len_device if prefix_len_device is not None else meta.seq_lens,  # placeholder when unused
        window or 0,
        *(cfg.kv_scales or (meta.seq_lens, meta.seq_lens)),  # placeholders without an FP8 cache
        k_cache.shape[1],
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out_strides,
        *lse_strides,
        *meta.block_tables.stride(),
        GROUP=cfg.group,
        HEAD_DIM=cfg.head_dim,
        HEAD_DIM_PAD=cfg.head_dim_pad,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        MODE=mode,
        WRITE_LSE=lse is not None,
        DOT_DTYPE=_dot_dtype(q.dtype),
        # fp32 inputs would otherwise run their dots in TF32 (10-bit mantissa).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        DYNAMIC_PREFIX=prefix_len_device is not None,
        KV_FP8=cfg.kv_scales is not None,
        SLIDING=window is not None,
        SPLIT_TILES=split_tiles,
        num_warps=cfg.num_warps,
    )
