"""Where a kept int4 projection should stop calling its kernel and multiply by an unpacked float32 (or bfloat16)
weight instead: the crossing point behind ``DENSE_MIN_ROWS`` in ``gpu_workers/engine/quantization/cpu_linear.py``.

For SmolLM2-135M's projections as the engine merges them (qkv 960x576, o 576x576, gate/up 3072x576, down
576x1536; groups of 32), per number of rows (the tokens of one step), one layer's four products through each
path with bfloat16 activations, as ``up`` runs them: ``kernel`` (``_weight_int4pack_mm_for_cpu``) and
``unpacked`` (the layer's own dense path: the weight unpacked into its scratch buffer, then a float32 GEMM, or a
bfloat16 one), and ``int8`` (the int4 x int8 kernel, ``cpu_int4_q8.py``, where it builds). Best of ``--rounds``.

    python -m benchmarks.int4_dense_prefill [--threads 2] [--rounds 7] [--rows 16 64 128 400]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from benchmarks.common import best_ms
from gpu_workers.engine.quantization import cpu_int4_q8
from gpu_workers.engine.quantization.cpu_linear import DENSE_MIN_ROWS, DENSE_PATH, KERNEL_DTYPE, CpuInt4Linear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
ROWS = (16, 32, 64, 96, 128, 192, 256, 400, 512)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    layers = [CpuInt4Linear.from_float(torch.randn(n, k) * 0.05) for n, k in SHAPES]

    def kernel(xs: list[torch.Tensor]) -> None:
        for layer, x in zip(layers, xs, strict=True):
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, layer.group_size, layer.scales_and_zeros)

    on_int8 = [copy.deepcopy(layer) for layer in layers] if cpu_int4_q8.available() else []
    on_int8 = [layer for layer in on_int8 if layer.use_int8_activations()]

    def int8(xs: list[torch.Tensor]) -> None:
        for layer, x in zip(on_int8, xs, strict=True):
            cpu_int4_q8.mm(x, layer.q4, layer.q4_d, layer.q4_z, layer.q4_isa).to(KERNEL_DTYPE)

    def unpacked(xs: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        for layer, x in zip(layers, xs, strict=True):
            layer._dense_mm(x, dtype).to(KERNEL_DTYPE)

    one_row = [torch.randn(1, k).to(KERNEL_DTYPE) for _, k in SHAPES]
    unpack_ms = best_ms(lambda: unpacked(one_row), args.rounds)
    print(f"torch {torch.__version__}, {args.threads} threads; unpacking one layer's weights: {unpack_ms:.2f} ms")
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"DENSE_MIN_ROWS = {DENSE_MIN_ROWS}, dense path {'on' if DENSE_PATH else 'off'} ({capability})\n")
    print(
        "| rows | int4 kernel ms | unpacked + float32 GEMM ms | kernel / unpacked | unpacked + bfloat16 GEMM ms "
        f"| kernel / unpacked bf16 | int4 x int8 kernel ({cpu_int4_q8.isa_name()}) ms | int8 / fastest unpacked |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            xs = [torch.randn(rows, k).to(KERNEL_DTYPE) for _, k in SHAPES]
            k_ms = best_ms(lambda xs=xs: kernel(xs), args.rounds)
            u_ms = best_ms(lambda xs=xs: unpacked(xs), args.rounds)
            b_ms = best_ms(lambda xs=xs: unpacked(xs, torch.bfloat16), args.rounds)
            q_ms = best_ms(lambda xs=xs: int8(xs), args.rounds) if on_int8 else float("nan")
            print(f"| {rows} | {k_ms:.2f} | {u_ms:.2f} | {k_ms / u_ms:.2f} | {b_ms:.2f} | {k_ms / b_ms:.2f} "
                  f"| {q_ms:.2f} | {q_ms / min(u_ms, b_ms):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
