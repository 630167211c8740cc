"""torch's CPU quantized matmuls against dense ones at batch 1, on SmolLM2-135M's projection shapes: why the
kept-quantized layers (``gpu_workers/engine/quantization/cpu_linear.py``) run their kernels in bfloat16.

Per activation dtype (float32, bfloat16, float16): one decode step's projections (30 layers of qkv 960x576,
o 576x576, gate/up 3072x576, down 576x1536, each layer its own weights so they stream from memory as in the
model) and the LM head (49152x576), as a dense ``x @ W^T``, int4 (``_weight_int4pack_mm_for_cpu``, groups of 32)
and int8 (``_weight_int8pack_mm``). Best of ``--rounds``, milliseconds.

    python -m benchmarks.cpu_quant_kernels [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD = (49152, 576)
GROUP = 32


def best_ms(calls: list[Callable[[], object]], rounds: int) -> float:
    for call in calls:
        call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def weights(shapes: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, list[Callable[[], object]]]:
    """Per kind (dense / int4 / int8), one matmul call per shape, each on its own random weight."""
    xs = {k: torch.randn(1, k).to(dtype) for k in {k for _, k in shapes}}
    calls: dict[str, list[Callable[[], object]]] = {"dense": [], "int4": [], "int8": []}
    for n, k in shapes:
        x = xs[k]
        dense = torch.randn(n, k).to(dtype)
        calls["dense"].append(lambda x=x, w=dense: torch.nn.functional.linear(x, w))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = torch.randn(k // GROUP, n, 2).to(dtype)
        calls["int4"].append(lambda x=x, p=packed, s=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, GROUP, s))
        q8, s8 = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).to(dtype)
        calls["int8"].append(lambda x=x, q=q8, s=s8: torch.ops.aten._weight_int8pack_mm(x, q, s))
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), "
          f"best of {args.rounds}, load average {load:.2f}")  # fmt: skip
    print("| activations | part | dense ms | int4 g32 ms | int8 ms |\n| --- | --- | ---: | ---: | ---: |")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for part, shapes in (("30 layers", list(SHAPES) * LAYERS), ("LM head", [LM_HEAD])):
            calls = weights(shapes, dtype)
            ms = {kind: best_ms(c, args.rounds) for kind, c in calls.items()}
            name = str(dtype).removeprefix("torch.")
            print(f"| {name} | {part} | {ms['dense']:.1f} | {ms['int4']:.1f} | {ms['int8']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
