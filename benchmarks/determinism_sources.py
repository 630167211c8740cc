"""Where batch variance comes from on this CPU: for each kernel a token's row goes through, how many different
results one row gets when it is placed at the start, middle and end of batches of 1 to 513 rows (1: the row's result
never depends on its batch). SmolLM2-135M's shapes; the plain kernels and the deterministic mode's versions.

    python -m benchmarks.determinism_sources
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_workers.engine.execution.batch_invariant import invariant_linear
from gpu_workers.engine.quantization.cpu_linear import CpuInt4Linear

ROWS = (*range(1, 40), 63, 64, 65, 100, 127, 128, 129, 255, 256, 300, 513)
Kernel = Callable[[torch.Tensor], torch.Tensor]


def distinct_results(f: Kernel, k: int, dtype: torch.dtype) -> int:
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(k, generator=gen).to(dtype)
    outs: list[torch.Tensor] = []
    for m in ROWS:
        for place in sorted({0, m // 3, m // 2, m - 1}):
            x = torch.randn(m, k, generator=gen).to(dtype)
            x[place] = row
            outs.append(f(x)[place])
    return len({tuple(o.float().tolist()) for o in outs})


def main() -> None:
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for k, n in ((576, 1536), (1536, 576), (576, 49152)):
        for dtype in (torch.float32, torch.bfloat16):
            layer = torch.nn.Linear(k, n, bias=False).to(dtype)
            plain = distinct_results(lambda x, layer=layer: F.linear(x, layer.weight), k, dtype)
            padded = distinct_results(lambda x, layer=layer: invariant_linear(layer, x), k, dtype)
            print(f"linear [{n}, {k}] {dtype}: plain {plain}, the mode's {padded}", flush=True)
    int4 = CpuInt4Linear.from_float(torch.randn(1536, 576))
    print(f"int4 kernel [1536, 576]: {distinct_results(int4, 576, torch.bfloat16)}", flush=True)
    weight = torch.randn(576)
    for dtype in (torch.float32, torch.bfloat16):
        rms = distinct_results(lambda x, dt=dtype: weight.to(dt) * F.rms_norm(x, (576,), eps=1e-5), 576, dtype)
        print(f"rms_norm {dtype}: {rms}", flush=True)


if __name__ == "__main__":
    main()
