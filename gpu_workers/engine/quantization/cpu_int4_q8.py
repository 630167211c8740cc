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
# The kernel takes groups in pairs: K a multiple of 64 (every shipped model's is).
K_MULTIPLE = 2 * GROUP
ROW_BLOCK = 4  # output rows stored and computed together (N a multiple of it: every int4 layer's is 16)
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
            extra_cflags=["-O3", "-fopenmp"],
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
    """Whether ``cpu_int4_activations=setting`` puts the layers on this kernel here. "auto" does where torch
    dispatches to AVX2: there the layers took 0.49x the time of torch's kernel at one row and 0.78-0.82x at 4-64
    (docs/benchmarks.md). With AVX-512 torch's own kernel is vectorized too (0.90-1.01x), so "auto" keeps bfloat16
    activations there, which also lose less precision."""
    if setting not in ACTIVATIONS:
        raise ValueError(f"unknown cpu_int4_activations {setting!r}; use one of {ACTIVATIONS}")
    if setting == "int8":
        return True
    if setting == "auto":
        return torch.backends.cpu.get_cpu_capability() == "AVX2" and available()
    return False


def _register_fake() -> None:
    @torch.library.register_fake("sluicegate_cpu::int4_q8_mm")
    def _(x: torch.Tensor, q4: torch.Tensor, d: torch.Tensor, m: torch.Tensor, isa: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], q4.shape[0]), dtype=torch.float32)


def pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's form of codes ``[N, K]`` in 0..15 standing for ``(codes - 8) * scale + zero`` per group of 32:
    ``q4`` ``[N, K / 2]`` (byte j of a group pair: code j of the first group, low nibble; of the second, high), and
    ``d``, ``m`` ``[N, K / 32]`` float32 with ``w = d * code + m``; codes and ``d`` stored by blocks of four rows
    (shapes kept, contents reordered: see the kernel's ``Problem``)."""
    n, k = codes.shape
    if k % K_MULTIPLE or n % ROW_BLOCK:
        raise ValueError(f"int4 x int8 kernel: [N, K] multiples of [{ROW_BLOCK}, {K_MULTIPLE}], got {[n, k]}")
    blocks, pairs = n // ROW_BLOCK, k // K_MULTIPLE
    split = codes.to(torch.uint8).reshape(n, pairs, 2, GROUP)
    q4 = split[:, :, 0] | (split[:, :, 1] << 4)  # [N, pairs, 32]
    # By blocks of four rows, in the order the kernel reads them: [N / 4, pairs, 4, 32] bytes, [N / 4, pairs, 4, 2].
    q4 = q4.reshape(blocks, ROW_BLOCK, pairs, GROUP).transpose(1, 2).reshape(n, k // 2).contiguous()
    d, z = scale.float(), zero.float()
    d_blocked = d.reshape(blocks, ROW_BLOCK, pairs, 2).transpose(1, 2).reshape(n, k // GROUP).contiguous()
    return q4, d_blocked, (z - 8 * d).contiguous()


def codes_of(q4: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The codes ``[stop - start, K]`` (uint8) of output rows ``start:stop`` (multiples of four), read back from
    the kernel's layout."""
    n, k = q4.shape[0], 2 * q4.shape[1]
    pairs = k // K_MULTIPLE
    blocks = q4.view(n // ROW_BLOCK, pairs, ROW_BLOCK, GROUP)[start // ROW_BLOCK : stop // ROW_BLOCK].transpose(1, 2)
    return torch.stack([blocks & 15, blocks >> 4], dim=3).reshape(stop - start, k)


def weight_t(
    q4: torch.Tensor, d: torch.Tensor, m: torch.Tensor, start: int, stop: int, into: torch.Tensor
) -> torch.Tensor:
    """Columns ``start:stop`` of ``W^T`` in float32, ``d * code + m``, written into ``into`` ``[K, stop - start]``
    (contiguous): what a long prefill multiplies by, unpacked from this layout alone."""
    k, width = 2 * q4.shape[1], stop - start
    groups = k // GROUP
    into.copy_(codes_of(q4, start, stop).t())
    n = q4.shape[0]
    scale = d.view(n // ROW_BLOCK, groups // 2, ROW_BLOCK, 2).transpose(1, 2).reshape(n, groups)[start:stop]
    view = into.view(groups, GROUP, width)
    view.mul_(scale.t().unsqueeze(1)).add_(m[start:stop].t().unsqueeze(1))
    return into


def mm(x: torch.Tensor, q4: torch.Tensor, d: torch.Tensor, m: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` as float32 ``[M, N]`` through the kernel (``isa`` forces a loop, for the tests)."""
    if x.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads float32 or bfloat16 (a float16 model)
        x = x.float()
    return torch.ops.sluicegate_cpu.int4_q8_mm(x, q4, d, m, kernel_isa() if isa is None else isa)
