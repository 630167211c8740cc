"""torch's packed int4 CPU layout read back into codes, and the per-thread scratch buffers a long prefill unpacks
into (``cpu_linear.CpuInt4Linear``'s dense path).

``_convert_weight_to_int4pack_for_cpu`` lays rows out by the instruction set torch dispatches to
(:class:`PackLayout`): blocks of 64 rows on AVX512, 32 on AVX2 and without vector instructions. The layout is
checked once against the packer itself; where it is not the one expected (an instruction set not described here),
``pack_layout`` says so and nothing unpacks.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackLayout:
    """How ``_convert_weight_to_int4pack_for_cpu`` lays out rows (``N``): blocks of ``block_n`` rows, each stored
    K-major as ``[K, block_n / 2]`` bytes. In a whole block of a vectorized build (``split``) the low nibbles of a
    ``k``'s bytes are the block's first half of rows in order and the high nibbles its second half (AVX512 pairs
    rows ``d`` / ``d + 32`` and ``d + 16`` / ``d + 48`` in bytes ``d`` and ``16 + d``, AVX2 rows ``d`` / ``d + 16``
    in byte ``d``). A last, partial block (16, 32 or 48 rows), and every block of the plain build, pairs rows
    ``2 j`` and ``2 j + 1`` in byte ``j``."""

    block_n: int
    split: bool


def _expected_layout() -> PackLayout:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return PackLayout(64, split=True)
    if capability.startswith("AVX2"):
        return PackLayout(32, split=True)
    return PackLayout(32, split=False)


@functools.cache
def pack_layout() -> PackLayout | None:
    """The packer's layout on this machine, once checked against the packer itself (whole and partial blocks);
    None when it is not the expected one, and then no layer unpacks (the kernel multiplies every call)."""
    layout = _expected_layout()
    n, k = 2 * layout.block_n + 16, 32
    codes = torch.arange(n * k, dtype=torch.int32).reshape(n, k) * 7 % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).view(-1)
    unpacked = torch.empty(k, n)
    for start, stop in ((0, 2 * layout.block_n), (2 * layout.block_n, n)):
        unpack_codes(packed, layout, n, k, start, stop, unpacked[:, start:stop])
    if torch.equal(unpacked.t(), codes.float()):
        return layout
    log.warning(
        "int4 CPU layers: torch's packed layout on %s is not the expected one; long prefills use the int4 kernel",
        torch.backends.cpu.get_cpu_capability(),
    )
    return None


def unpack_codes(
    packed: torch.Tensor, layout: PackLayout, n: int, k: int, start: int, stop: int, into: torch.Tensor
) -> None:
    """Codes of rows ``start:stop`` (whole blocks, or the last partial block) into ``into`` ``[K, stop - start]``
    (contiguous), as floats 0..15: laid out K-major, the codes are ``W^T`` with no transpose copy."""
    block, half, width = layout.block_n, layout.block_n // 2, stop - start
    whole = n // block
    if start < whole * block:
        blocks = packed[: whole * k * half].view(whole, k, half)[start // block : stop // block].permute(1, 0, 2)
        if layout.split:
            dense = into.view(k, width // block, block)
            dense[..., :half] = blocks & 15
            dense[..., half:] = blocks >> 4
        else:
            pairs = into.view(k, width // block, half, 2)
            pairs[..., 0] = blocks & 15
            pairs[..., 1] = blocks >> 4
    else:
        tail = packed[whole * k * half :].view(k, width // 2)
        pairs = into.view(k, width // 2, 2)
        pairs[..., 0] = tail & 15
        pairs[..., 1] = tail >> 4


class _ScratchBuffers(threading.local):
    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}


_scratch_buffers = _ScratchBuffers()


def scratch(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``numel`` elements of this thread's scratch buffer of ``dtype``, grown as needed ."""
    buffers = _scratch_buffers.by_dtype
    buffer = buffers.get(dtype)
    # A buffer made under inference mode (the engine's steps) cannot be written outside it (a check, a test): anew.
    stale = buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
    if buffer is None or buffer.numel() < numel or stale:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]
