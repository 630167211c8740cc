"""Turns the packed tensors of an AutoAWQ (GEMM) or GPTQ checkpoint projection into the one
layout ``Int4Linear`` keeps, so the kernel and the torch fallback know a single format.

The engine's layout (per projection with ``K`` inputs, ``N`` outputs and ``G`` groups):

- ``qweight`` int32 ``[K / 8, N]``: eight 4-bit values per int32 along the input dimension, the
  value for input row ``8 * r + i`` in bits ``4 i .. 4 i + 3`` (GPTQ's own order, so GPTQ weights
  are taken as they are);
- ``zeros`` uint8 ``[G, N]``: the unpacked zero points (one byte each: G is K / group size, so
  this costs 1/16 bit per weight at group size 128, and the kernel needs no second unpack);
- ``scales`` ``[G, N]`` in the model's dtype; ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``
  with ``g = k // group_size``, or ``g = g_idx[k]`` for GPTQ act-order.

Published layouts it reads: AWQ GEMM ``qweight`` is ``[K, N / 8]``, packed along the outputs in
the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (nibble ``i`` of a word holds output ``ORDER[i]`` of
its eight); ``qzeros`` ``[G, N / 8]`` packed the same way. GPTQ ``qzeros`` ``[G, N / 8]`` is packed
along the outputs in plain order and, in the v1 ``gptq`` format, stores each zero point minus one.
"""

from __future__ import annotations

import torch

from .int4_config import Int4Config

PACK = 8  # 4-bit values per int32
# Output position of nibble i in an AWQ GEMM word, and its inverse (nibble holding output j).
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE_OF_OUTPUT: tuple[int, ...] = tuple(AWQ_ORDER.index(j) for j in range(PACK))


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def unpack_along_cols(packed: torch.Tensor, nibble_of_col: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[R, C / 8]`` -> int32 ``[R, C]`` in 0..15; ``nibble_of_col[j]`` is the nibble holding
    column ``j`` of each group of eight (plain order when None)."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _shifts(packed.device)) & 0xF  # [R, C/8, 8]
    if nibble_of_col is not None:
        nibbles = nibbles[..., list(nibble_of_col)]
    return nibbles.reshape(packed.shape[0], -1)


def unpack_along_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R / 8, C]`` -> int32 ``[R, C]`` in 0..15 (nibble ``i`` of row ``r`` is row ``8 r + i``)."""
    nibbles = (packed.to(torch.int32).unsqueeze(1) >> _shifts(packed.device).view(1, PACK, 1)) & 0xF
    return nibbles.reshape(-1, packed.shape[1])


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """int ``[R, C]`` in 0..15 (R a multiple of 8) -> int32 ``[R / 8, C]``, the engine's layout."""
    rows, cols = values.shape
    if rows % PACK:
        raise ValueError(f"cannot pack {rows} rows into int32 words of {PACK}")
    grouped = values.to(torch.int64).reshape(rows // PACK, PACK, cols)
    word = (grouped << (4 * torch.arange(PACK, device=values.device)).view(1, PACK, 1)).sum(dim=1)
    # Bit 31 set means a negative int32: wrap explicitly rather than rely on an overflowing cast.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _check_shapes(name: str, qweight: torch.Tensor, scales: torch.Tensor, n: int, groups: int) -> None:
    if tuple(scales.shape) != (groups, n):
        raise ValueError(
            f"{name}: scales has shape {tuple(scales.shape)}, expected {(groups, n)} for qweight {tuple(qweight.shape)}"
        )


def num_groups(cfg: Int4Config, in_features: int) -> int:
    """Scale rows of a projection with ``in_features`` inputs."""
    if cfg.group_size is None:
        return 1
    if in_features % cfg.group_size:
        raise ValueError(f"in_features={in_features} is not a multiple of the group size {cfg.group_size}")
    return in_features // cfg.group_size


def awq_to_engine(
    name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, cfg: Int4Config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors -> ``(qweight [K/8, N], zeros uint8 [G, N], scales [G, N])``."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{name}: AWQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    groups = num_groups(cfg, k)
    _check_shapes(name, qweight, scales, n, groups)
    if tuple(qzeros.shape) != (groups, n // PACK):
        raise ValueError(f"{name}: qzeros has shape {tuple(qzeros.shape)}, expected {(groups, n // PACK)}")
    values = unpack_along_cols(qweight, AWQ_NIBBLE_OF_OUTPUT)
    zeros = unpack_along_cols(qzeros, AWQ_NIBBLE_OF_OUTPUT)
    return pack_along_rows(values), zeros.to(torch.uint8), scales


def gptq_to_engine(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    cfg: Int4Config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ tensors -> ``(qweight [K/8, N], zeros uint8 [G, N], scales [G, N], g_idx [K] or None)``.

    ``g_idx`` is kept only for act-order checkpoints; without act-order it must be the plain
    ``k // group_size`` (some writers store it anyway), else the checkpoint contradicts its config.
    """
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{name}: GPTQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    groups = num_groups(cfg, k)
    _check_shapes(name, qweight, scales, n, groups)
    if tuple(qzeros.shape) != (groups, n // PACK):
        raise ValueError(f"{name}: qzeros has shape {tuple(qzeros.shape)}, expected {(groups, n // PACK)}")
    zeros = (unpack_along_cols(qzeros) + cfg.zero_offset).clamp_(0, 15)
    sequential = torch.arange(k, dtype=torch.int32, device=qweight.device) // (cfg.group_size or k)
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"{name}: g_idx has shape {tuple(g_idx.shape)}, expected {(k,)}")
        g_idx = g_idx.to(torch.int32)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{name}: g_idx values must lie in [0, {groups})")
    if not cfg.desc_act:
        if g_idx is not None and not torch.equal(g_idx, sequential):
            raise ValueError(f"{name}: g_idx is not k // group_size but quantization_config has desc_act=false")
        return qweight.to(torch.int32), zeros.to(torch.uint8), scales, None
    return qweight.to(torch.int32), zeros.to(torch.uint8), scales, sequential if g_idx is None else g_idx


def dequantize(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The engine layout -> float weight ``[K, N]`` (input-major, so ``x @ w`` is the projection).
    Without ``g_idx`` the groups are contiguous runs of ``K / zeros.shape[0]`` rows."""
    values = unpack_along_rows(qweight)
    k, n = values.shape
    if g_idx is not None:
        groups = g_idx.long()
        return ((values - zeros[groups].to(torch.int32)).to(dtype)) * scales[groups].to(dtype)
    # Contiguous groups: broadcast each group's zero and scale over its rows instead of gathering
    # a [K, N] copy of them (the CPU fallback runs this on every call).
    grouped = values.view(zeros.shape[0], -1, n) - zeros.unsqueeze(1).to(torch.int32)
    return (grouped.to(dtype) * scales.unsqueeze(1).to(dtype)).view(k, n)
