"""The mixture-of-experts block's torch grouped path (``gpu_workers/engine/models/moe.py``: slots sorted by expert,
one matmul per expert group, one ``index_add_``) against a naive per-expert loop (for each of the E experts: mask
the tokens routed to it, matmul them, add them back weighted), on the CPU.

A Mixtral-shaped but small expert layer: hidden 1024, expert intermediate 3584 (Mixtral's 4096 : 14336), 8 experts,
top-2, float32, over 1, 8 and 64 tokens; each run's two outputs are checked equal first. Median of ``--rounds`` calls
after a warm-up, milliseconds, and naive / grouped. A second table: the experts kept int4 / int8 (``cpu-int4`` /
``cpu-int8``, each expert group through torch's CPU kernels, activations in bfloat16) against the grouped float path
in float32 and in bfloat16, at 1 and 8 tokens.

    python -m benchmarks.moe_block [--threads 1] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_workers.engine.models.moe import experts_grouped, experts_torch, route
from gpu_workers.engine.quantization.cpu_experts import CpuQuantizedExperts

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 3584, 8, 2
TOKENS = (1, 8, 64)


def naive_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Every expert in turn over the tokens routed to it, found by a mask (the loop the grouped path replaces)."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        hit = ids == expert  # [T, k]
        rows = hit.any(dim=-1)
        if not bool(rows.any()):
            continue
        gate, up = F.linear(x[rows], gate_up[expert]).split(INTER, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out[rows] += y * (weights * hit).sum(dim=-1)[rows, None]
    return out


def median_ms(call: Callable[[], object], rounds: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER) * 0.02
    router = torch.randn(EXPERTS, HIDDEN) * 0.02
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.rounds}, "
          f"load average {os.getloadavg()[0]:.2f}; H={HIDDEN} I={INTER} E={EXPERTS} top-{TOP_K} float32")  # fmt: skip
    print(
        "| tokens | experts hit | grouped ms | naive loop ms | naive / grouped |\n| ---: | ---: | ---: | ---: | ---: |"
    )
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN)
        weights, ids = route(F.linear(x, router), TOP_K, renormalize=True)
        grouped = experts_torch(x, gate_up, down, weights, ids)
        torch.testing.assert_close(naive_experts(x, gate_up, down, weights, ids), grouped, rtol=1e-4, atol=1e-5)
        routed = (x, gate_up, down, weights, ids)
        ms_grouped = median_ms(lambda routed=routed: experts_torch(*routed), args.rounds)
        ms_naive = median_ms(lambda routed=routed: naive_experts(*routed), args.rounds)
        hit = len(set(ids.flatten().tolist()))
        print(f"| {tokens} | {hit} | {ms_grouped:.2f} | {ms_naive:.2f} | {ms_naive / ms_grouped:.2f} |", flush=True)
    quantized_rows(gate_up, down, router, args.rounds)
    return 0


def _quantized_runs(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: tuple[torch.Tensor, torch.Tensor],
    bf16: tuple[torch.Tensor, torch.Tensor],
    kept: dict[str, CpuQuantizedExperts],
) -> dict[str, Callable[[], torch.Tensor]]:
    xb = x.bfloat16()
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "float32": lambda: experts_torch(x, *fp32, weights, ids),
        "bfloat16": lambda: experts_torch(xb, *bf16, weights, ids),
    }
    for name, e in kept.items():
        runs[name] = lambda e=e: experts_grouped(xb, weights, ids, EXPERTS, e.gate_up, e.down)
    return runs


def quantized_rows(gate_up: torch.Tensor, down: torch.Tensor, router: torch.Tensor, rounds: int) -> None:
    """The same experts kept int4 / int8 (``quantization/cpu_experts.py``: each expert group through torch's CPU
    kernels) against the dequantized grouped path in float32 and bfloat16, at 1 and 8 tokens (decode steps)."""
    kept = {m: CpuQuantizedExperts.from_stacked(m, gate_up, down) for m in ("cpu-int4", "cpu-int8")}
    bf16 = (gate_up.bfloat16(), down.bfloat16())
    print("\n| tokens | float32 ms | bfloat16 ms | kept int4 ms | kept int8 ms | float32 / int4 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens in (1, 8):
        x = torch.randn(tokens, HIDDEN)
        weights, ids = route(F.linear(x, router), TOP_K, renormalize=True)
        want = experts_torch(x, gate_up, down, weights, ids)
        runs = _quantized_runs(x, weights, ids, (gate_up, down), bf16, kept)
        for name in kept:  # the kept weights' own error stays that of 4 / 8 bits
            got = runs[name]().float()
            cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
            assert cosine > 0.99, (name, cosine)
        ms = {name: median_ms(run, rounds) for name, run in runs.items()}
        print(
            f"| {tokens} | {ms['float32']:.2f} | {ms['bfloat16']:.2f} | {ms['cpu-int4']:.2f} | {ms['cpu-int8']:.2f} "
            f"| {ms['float32'] / ms['cpu-int4']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
