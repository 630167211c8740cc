"""Compile (not run) the INT4 dequant-GEMM for sm_90 through its real launcher, with CPU tensors standing in
for CUDA ones, reusing the attention kernels' compile harness (``../attention/sm90_compile.py``: Triton's
argument binding plus ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` and ptxas). It reports each
variant's registers, spill stack and shared memory; exits 1 when one fails or a half-precision one spills,
77 when the Triton internals the harness uses moved.

Usage: ``python3 tests/unit/engine/quantization/int4_sm90_compile.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_HARNESS = Path(__file__).resolve().parents[1] / "attention" / "sm90_compile.py"
_spec = importlib.util.spec_from_file_location("sm90_compile", _HARNESS)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)  # patches JITFunction.run to compile instead of launching

import torch  # noqa: E402

from gpu_workers.engine.quantization.int4_kernel import int4_matmul  # noqa: E402


def case(dtype: torch.dtype, m: int, k: int, n: int, group: int, act_order: bool) -> None:
    harness.CASE[0] = f"{dtype} m={m} k={k} n={n} g={group} act_order={act_order}"
    x = torch.zeros(m, k, dtype=dtype)
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    scales = torch.zeros(k // group, n, dtype=dtype)
    zeros = torch.zeros(k // group, n, dtype=torch.uint8)
    g_idx = torch.zeros(k, dtype=torch.int32) if act_order else None
    int4_matmul(x, qweight, scales, zeros, g_idx, group)


def main() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for m in (1, 24, 33, 512):  # the launcher's three BLOCK_M choices
            case(dtype, m, 4096, 6144, 128, False)
        case(dtype, 8, 4096, 6144, 128, True)
    case(torch.float32, 8, 64, 192, 32, False)  # the CPU-dtype tiny model
    results = harness.RESULTS
    fails = [r for r in results if r[1].startswith("FAIL")]
    spills = [r for r in results if "float32" not in r[0] and " stack=0 " not in r[1] and r not in fails]
    print(f"\n{len(results)} compiled, {len(fails)} failed, {len(spills)} half-precision variants spill")
    for name, info in fails + spills:
        print(name, info)
    sys.exit(1 if fails or spills else 0)


if __name__ == "__main__":
    main()
