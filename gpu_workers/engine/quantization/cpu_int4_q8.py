"""4-bit weights times 8-bit activations on the CPU: what ``cpu-int4`` layers multiply, summed in integers.

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) widens every 4-bit code to a float and multiplies it by
bfloat16 activations. A decode step on one thread spends most of its time there, and the kernel is compute-bound,
most of all where torch dispatches to AVX2 (half its AVX-512 speed). llama.cpp's answer, used here the same way, is
to quantize the activations too: each group of 32 values of a row to int8 by its own absolute maximum, so a group's
product is one integer dot product (AVX-512 VNNI ``vpdpbusd``, or AVX2 ``vpmaddubsw`` + ``vpmaddwd``) scaled once,
plus the group's minimum term from the activations' exact float sum.

No library ships this kernel for x86 in a form the project can install: torch has only the float-activation kernel
above, torchao's wheels on PyPI carry no CPU kernels, fbgemm's int8 GEMM (the W8A8 LM head's) needs int8 weights per
output channel and was slower than torch's int4 kernel at one row for these small layers, and Inductor's code for an
unpack-and-reduce written in torch ops was several times slower still (docs/benchmarks.md). So the kernel is ours,
``cpu_int4_q8.cpp``, built once per machine by torch's C++ extension loader (a C++ compiler is needed, as for
compiled decode) and registered as the torch op ``sluicegate_cpu::int4_q8_mm``, which Inductor calls from a
compiled step like any aten op.

Every row is quantized and summed alone, in one order, so a row's result never depends on the batch or the thread
count: the deterministic mode keeps this path. Which loop runs follows what torch dispatches to
(``ATEN_CPU_CAPABILITY``), so a run capped at AVX2 takes the AVX2 loop.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_int4_q8.cpp")
GROUP = 32
ROW_BLOCK = 8  # output rows interleaved and computed together (N a multiple of it: every shipped model's is)
ISA_SCALAR, ISA_AVX2, ISA_VNNI = 0, 1, 2
ACTIVATIONS = ("bfloat16", "int8", "auto")
_ISA_NAMES = {ISA_SCALAR: "scalar", ISA_AVX2: "AVX2", ISA_VNNI: "AVX-512 VNNI"}


def kernel_isa() -> int:
    """The loop this CPU runs, within what torch dispatches to: VNNI only where torch takes AVX-512."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") and torch.cpu._is_vnni_supported():
        return ISA_VNNI
    if capability.startswith(("AVX2", "AVX512")):
        return ISA_AVX2
    return ISA_SCALAR


def isa_name() -> str:
    return _ISA_NAMES[kernel_isa()]


@functools.cache
def build_problem() -> str | None:
    """Why the kernel cannot run here (no compiler, a failed build), or None once it is built and registered."""
    try:
        from torch.utils.cpp_extension import load

        load(
            name="sluicegate_cpu_int4_q8",
            sources=[str(SOURCE)],
            # OpenMP, as torch's own ops: at::parallel_for is an OpenMP pragma in ATen's headers, serial without it.
            # The libgomp.so.1 it needs is the one torch already loaded (same soname), so there is one thread pool.
            # No contraction of a * b + c into one rounding beyond the fma calls written out: every loop must give
            # the scalar reference's bits.
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # any failure to build or load means: not here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"the int4 x int8 CPU kernel did not build: {first[:300]}"
    _register_fake()
    return None


def problem() -> str | None:
    """Why layers cannot take the kernel here, or None: it must build, and torch must dispatch to AVX2 at least
    (the scalar loop is the tests' reference, far slower than torch's kernel)."""
    if kernel_isa() == ISA_SCALAR:
        return f"it needs AVX2; torch dispatches to {torch.backends.cpu.get_cpu_capability()} here"
    return build_problem()


def available() -> bool:
    return problem() is None


def wanted(setting: str) -> bool:
    """Whether ``cpu_int4_activations=setting`` puts the layers on this kernel here. "auto" does wherever the kernel
    runs (torch dispatching to AVX2 or AVX-512, the kernel built): the 120 products of a SmolLM2 step took 0.43x the
    time of torch's kernel at one row and 0.46x at eight on AVX2, 0.80x and 0.54x with AVX-512 VNNI; a one-thread
    decode step of the served default 1.3x faster at batch 1 and 1.6x at batch 8 with AVX-512 (docs/benchmarks.md).
    The price is llama.cpp's: 8-bit activations move a few near-ties (docs/quality.md); "bfloat16" keeps torch's
    kernel and the more precise products."""
    if setting not in ACTIVATIONS:
        raise ValueError(f"unknown cpu_int4_activations {setting!r}; use one of {ACTIVATIONS}")
    if setting == "int8":
        return True
    if setting == "auto":
        return available()
    return False


def _register_fake() -> None:
    @torch.library.register_fake("sluicegate_cpu::int4_q8_mm")
    def _(x: torch.Tensor, q4: torch.Tensor, d: torch.Tensor, z: torch.Tensor, isa: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], q4.shape[0]), dtype=torch.float32)


def pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's form of codes ``[N, K]`` in 0..15 standing for ``(codes - 8) * scale + zero`` per group of 32:
    ``q4`` ``[N, K / 2]`` bytes and ``d``, ``z`` ``[N, K / 32]``, the scale and zero in bfloat16 (as the layers keep
    them), shapes kept and contents reordered by blocks of eight rows (see the kernel's ``Problem``): per block and
    group, four runs of 32 bytes, run ``c`` holding for each row in turn its codes ``4c..4c+3`` in the low nibbles
    and ``16+4c..16+4c+3`` in the high ones; the block's eight scales and eight zeros per group."""
    n, k = codes.shape
    if k % GROUP or n % ROW_BLOCK:
        raise ValueError(f"int4 x int8 kernel: [N, K] multiples of [{ROW_BLOCK}, {GROUP}], got {[n, k]}")
    blocks, groups = n // ROW_BLOCK, k // GROUP
    # [block, row, group, half, run, byte]: the code at K = 32 group + 16 half + 4 run + byte.
    split = codes.to(torch.uint8).reshape(blocks, ROW_BLOCK, groups, 2, 4, 4)
    q4 = (split[:, :, :, 0] | (split[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(n, k // 2).contiguous()
    return q4, _blocked(scale.to(torch.bfloat16)), _blocked(zero.to(torch.bfloat16))


def _blocked(per_group: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` stored as ``[N / 8, G, 8]`` (shape kept)."""
    n, groups = per_group.shape
    return per_group.reshape(n // ROW_BLOCK, ROW_BLOCK, groups).transpose(1, 2).reshape(n, groups).contiguous()


def _unblocked(blocked: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` (multiples of eight) of a ``_blocked`` tensor, as ``[stop - start, G]``."""
    n, groups = blocked.shape
    rows = blocked.view(n // ROW_BLOCK, groups, ROW_BLOCK)[start // ROW_BLOCK : stop // ROW_BLOCK]
    return rows.transpose(1, 2).reshape(stop - start, groups)


def codes_of(q4: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The codes ``[stop - start, K]`` (uint8) of output rows ``start:stop`` (multiples of eight), read back from
    the kernel's layout."""
    n, k = q4.shape[0], 2 * q4.shape[1]
    runs = q4.view(n // ROW_BLOCK, k // GROUP, 4, ROW_BLOCK, 4)[start // ROW_BLOCK : stop // ROW_BLOCK]
    # [block, group, half, run, row, byte] -> [block, row, group, half, run, byte]
    halves = torch.stack([runs & 15, runs >> 4], dim=2)
    return halves.permute(0, 4, 1, 2, 3, 5).reshape(stop - start, k)


def weight_t(
    q4: torch.Tensor, d: torch.Tensor, z: torch.Tensor, start: int, stop: int, into: torch.Tensor
) -> torch.Tensor:
    """Columns ``start:stop`` of ``W^T`` in float32, ``d * code + (z - 8 d)``, written into ``into``
    ``[K, stop - start]`` (contiguous): what a long prefill multiplies by, unpacked from this layout alone."""
    k, width = 2 * q4.shape[1], stop - start
    into.copy_(codes_of(q4, start, stop).t())
    view = into.view(k // GROUP, GROUP, width)
    scale = _unblocked(d, start, stop).float()
    shift = _unblocked(z, start, stop).float() - 8 * scale
    view.mul_(scale.t().unsqueeze(1)).add_(shift.t().unsqueeze(1))
    return into


def mm(x: torch.Tensor, q4: torch.Tensor, d: torch.Tensor, z: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` as float32 ``[M, N]`` through the kernel (``isa`` forces a loop, for the tests)."""
    if x.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads float32 or bfloat16 (a float16 model)
        x = x.float()
    return torch.ops.sluicegate_cpu.int4_q8_mm(x, q4, d, z, kernel_isa() if isa is None else isa)
