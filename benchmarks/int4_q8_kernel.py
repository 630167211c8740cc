"""The 4-bit CPU layers on bfloat16 activations (torch's int4 kernel) against int8 activations (the int4 x int8
kernel, ``gpu_workers/engine/quantization/cpu_int4_q8.py``), on SmolLM2-135M's projection shapes.

One decode step's projections: 30 layers of qkv 960x576, o 576x576, gate/up 3072x576 and down 576x1536, each layer
its own weights so they stream from memory as in the model, as ``CpuInt4Linear`` layers (groups of 32), at each row
count of ``--rows``. Best of ``--rounds``, milliseconds for all 120 products; the ratio is int8 / bfloat16 time. The
ISA is the one torch dispatches to: ``ATEN_CPU_CAPABILITY=avx2`` measures the AVX2 loops on an AVX-512 machine.

    python -m benchmarks.int4_q8_kernel [--threads 1] [--rows 1 4 8 16 64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from benchmarks.common import best_ms
from gpu_workers.engine.quantization import cpu_int4_q8
from gpu_workers.engine.quantization.cpu_linear import CpuInt4Linear

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    problem = cpu_int4_q8.problem()
    if problem is not None:
        print(f"the int4 x int8 kernel cannot run here: {problem}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bf16 = [CpuInt4Linear.from_float(torch.randn(n, k) * 0.05) for _ in range(LAYERS) for n, k in SHAPES]
    int8 = [copy.deepcopy(layer) for layer in bf16]
    assert all(layer.use_int8_activations() for layer in int8)
    results = {"isa": torch.backends.cpu.get_cpu_capability(), "kernel_loop": cpu_int4_q8.isa_name(),
               "threads": args.threads, "rows": {}}  # fmt: skip
    print(f"torch dispatches to {results['isa']}; the int8 kernel runs its {results['kernel_loop']} loop; "
          f"{args.threads} thread(s); ms for {len(bf16)} products")  # fmt: skip
    print("| rows | bfloat16 activations (torch's int4 kernel) | int8 activations | int8 / bfloat16 |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
            ms = [
                best_ms(lambda layers=layers, x=inputs: [layer(x[layer.in_features]) for layer in layers], args.rounds)
                for layers in (bf16, int8)
            ]
            results["rows"][rows] = {"bfloat16_ms": round(ms[0], 2), "int8_ms": round(ms[1], 2)}
            print(f"| {rows} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[1] / ms[0]:.2f} |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
