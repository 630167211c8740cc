"""The mixture-of-experts block's torch grouped path (``gpu_workers/engine/models/moe.py``: slots sorted by expert,
one matmul per expert group, one ``index_add_``) against a naive per-expert loop (for each of the E experts: mask
the tokens routed to it, matmul them, add them back weighted), on the CPU.

A Mixtral-shaped but small expert layer: hidden 1024, expert intermediate 3584 (Mixtral's 4096 : 14336), 8 experts,
top-2, float32, over 1, 8 and 64 tokens; each run's two outputs are checked equal first. Median of ``--rounds`` calls
after a warm-up, milliseconds, and naive / grouped.

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

from gpu_workers.engine.models.moe import experts_torch, route

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
