"""Reads llama.cpp's 4-bit blocks (GGUF Q4_0, Q4_1, Q4_K) as the codes, scales and zeros of
``CpuInt4Linear`` (``w = (q - 8) * scale + zero`` over groups of 32 inputs), without dequantizing; and Q8_0
blocks as float (``CpuInt8Linear`` requantizes them per output channel), vectorized in torch.

Block layouts (ggml-common.h; every value little-endian, ``d`` / ``m`` / ``dmin`` float16):

- Q4_0, 32 weights in 18 bytes: ``d``, then 16 bytes whose low nibbles are weights 0..15 and high nibbles
  weights 16..31; ``w = d * (q - 8)``: scale ``d``, zero 0.
- Q4_1, 32 weights in 20 bytes: ``d``, ``m``, then the nibbles as Q4_0; ``w = d * q + m``: scale ``d``,
  zero ``m + 8 d``.
- Q4_K, 256 weights in 144 bytes: ``d``, ``dmin``, 12 bytes of eight 6-bit (scale, min) pairs, then 128
  bytes in four runs of 32 whose low nibbles are sub-block ``2 j`` and high nibbles sub-block ``2 j + 1``;
  sub-block ``s`` (32 weights) is ``w = d * sc_s * q - dmin * m_s``: scale ``d sc_s``, zero
  ``8 d sc_s - dmin m_s``.
- Q8_0, 32 weights in 34 bytes: ``d``, then 32 int8 ``q``; ``w = d * q``.

Everything is computed in float32, where these products are exact or within an ulp of llama.cpp's own
dequantization; the layer then stores scale and zero in bfloat16 (the kernel's dtype), which rounds them.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32  # weights per scale/zero: a Q4_0 / Q4_1 block, a Q4_K sub-block
# GGML type name -> bytes per block of its block size (32 or 256 weights)
BLOCK_BYTES: dict[str, tuple[int, int]] = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
INT4_GGUF_TYPES: tuple[str, ...] = tuple(BLOCK_BYTES)

Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes int32 [N, K], scale / zero float32 [N, K/32]


def _f16(raw: np.ndarray) -> torch.Tensor:
    """uint8 ``[..., 2]`` little-endian float16 bytes -> float32 ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """uint8 ``[..., B]`` -> int32 ``[..., 2 B]``: the B low nibbles, then the B high nibbles."""
    q = torch.from_numpy(np.ascontiguousarray(qs)).to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=-1)


def _k4_scale_min(scales: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes ``[..., 12]`` -> (sc, m), each int32 ``[..., 8]`` (ggml's get_scale_min_k4)."""
    s = torch.from_numpy(np.ascontiguousarray(scales)).to(torch.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], dim=-1), torch.cat([low_m, high_m], dim=-1)


def int4_parts(type_name: str, raw: np.ndarray, rows: int, cols: int) -> Int4Parts:
    """The raw bytes of a ``[rows, cols]`` tensor of ``type_name`` (Q4_0, Q4_1 or Q4_K) -> (codes, scale, zero)
    with ``w = (codes - 8) * scale + zero`` over groups of 32 columns."""
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"GGML type {type_name} has no 4-bit block layout here ({', '.join(INT4_GGUF_TYPES)})")
    block, size = BLOCK_BYTES[type_name]
    if cols % block:
        raise ValueError(f"{type_name} rows of {cols} values do not split into blocks of {block}")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // block, size)
    if type_name == "Q4_0":
        scale = _f16(blocks[..., 0:2])
        zero = torch.zeros_like(scale)
        codes = _nibbles(blocks[..., 2:18])
    elif type_name == "Q4_1":
        scale = _f16(blocks[..., 0:2])
        zero = _f16(blocks[..., 2:4]) + 8 * scale
        codes = _nibbles(blocks[..., 4:20])
    else:
        d, dmin = _f16(blocks[..., 0:2]).unsqueeze(-1), _f16(blocks[..., 2:4]).unsqueeze(-1)
        sc, m = _k4_scale_min(blocks[..., 4:16])
        scale = d * sc.float()
        zero = 8 * scale - dmin * m.float()
        # 128 bytes = four runs of 32: run j holds sub-blocks 2j (low nibbles) and 2j+1 (high nibbles).
        codes = _nibbles(blocks[..., 16:144].reshape(rows, cols // block, 4, 32))
    return codes.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)


def q8_0_float(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """The raw bytes of a ``[rows, cols]`` Q8_0 tensor -> float32 ``d * q`` (as the ``gguf`` library computes it,
    without its per-block Python-level overhead: seconds on an embedding of 28M weights)."""
    if cols % 32:
        raise ValueError(f"Q8_0 rows of {cols} values do not split into blocks of 32")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // 32, 34)
    d = _f16(blocks[..., 0:2]).unsqueeze(-1)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)).float()
    return (d * q).reshape(rows, cols)
