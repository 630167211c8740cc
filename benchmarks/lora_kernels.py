"""The batched multi-LoRA delta (``gpu_workers.engine.lora.add_lora``) against the base model's linears, on
SmolLM2-135M's projection shapes: what serving adapters adds to a step.

Per dtype: 30 layers of the base projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, each
layer its own weights as in the model) as ``F.linear``, against 30 layers of ``add_lora`` on every slice
(q, k, v, o, gate, up, down: 7 calls a layer, each its own slot-stacked A/B), for a decode batch (``--tokens``
sequences of one token, ``--adapters`` distinct slots) through both torch strategies, and a prefill batch
(``--prefill`` tokens split into ``--prefill-segments`` adapter runs) through both. Best of ``--rounds``, ms.
On a CUDA device (``--device cuda``) the Triton kernels run instead of the torch strategies.

    python -m benchmarks.lora_kernels [--threads 2] [--rounds 5] [--rank 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_workers.engine.lora import LoRABatch, add_lora

LAYERS = 30
HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
# (name, in, [(slice, out)]) per merged projection: qkv, o, gate_up, down.
PROJECTIONS = (
    ("qkv", HIDDEN, (("q", HIDDEN), ("k", KV), ("v", KV))),
    ("o", HIDDEN, (("o", HIDDEN),)),
    ("gate_up", HIDDEN, (("gate", INTERMEDIATE), ("up", INTERMEDIATE))),
    ("down", INTERMEDIATE, (("down", HIDDEN),)),
)


def best_ms(steps: dict[str, Callable[[], object]], rounds: int, device: torch.device) -> dict[str, float]:
    """Best of ``rounds`` per step, the steps interleaved round by round so load from neighbours hits all alike."""
    best = dict.fromkeys(steps, float("inf"))
    for step in steps.values():
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def graphed(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured once in a CUDA graph (after a warm-up run that compiles its kernels); returns the replay.

    The eager time is what a step the engine runs eagerly pays (prefill and mixed steps); the replay is what the
    same kernels cost without the host's launch overhead, as in the decode CUDA graphs' LoRA variants."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def model_calls(
    tokens: int, slots: int, rank: int, dtype: torch.dtype, device: torch.device, targets: set[str]
) -> tuple[Callable[[], None], Callable[[LoRABatch], None]]:
    """(all base linears of a step, all add_lora calls of a step for a given batch), each layer its own weights."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(device, dtype)

    xs = {k: rand(tokens, k) for k in (HIDDEN, INTERMEDIATE)}
    scales = torch.full((slots,), 2.0, device=device)
    base: list[tuple[torch.Tensor, torch.Tensor]] = []
    lora: list[tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, int]]]] = []
    for _ in range(LAYERS):
        for _, k, parts in PROJECTIONS:
            outs = [n for _, n in parts]
            base.append((xs[k], rand(sum(outs), k)))
            y = torch.zeros(tokens, sum(outs), device=device, dtype=dtype)
            offsets = [sum(outs[:i]) for i in range(len(outs))]
            adapted = [(rand(slots, rank, k), rand(slots, n, rank), off)
                       for (name, n), off in zip(parts, offsets, strict=True) if name in targets]  # fmt: skip
            if adapted:
                lora.append((xs[k], y, adapted))

    def base_step() -> None:
        for x, w in base:
            F.linear(x, w)

    def lora_step(batch: LoRABatch) -> None:
        for x, y, slices in lora:
            for a, b, off in slices:
                add_lora(y, x, a, b, scales, batch, out_offset=off)

    return base_step, lora_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="decode batch: sequences of one token each")
    parser.add_argument("--adapters", type=int, default=16, help="distinct adapter slots in the decode batch")
    parser.add_argument("--prefill", type=int, default=256, help="prefill batch: tokens")
    parser.add_argument("--prefill-segments", type=int, default=4, help="prefill batch: adapter runs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down", help="adapted slices (PEFT's default: q,v)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    targets = set(args.targets.split(","))
    print(f"torch {torch.__version__}, {device}, {args.threads} thread(s), best of {args.rounds}, rank {args.rank}, "
          f"targets {args.targets}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    cuda = device.type == "cuda"
    extra = (" base in a CUDA graph ms | add_lora in a CUDA graph ms |", " ---: | ---: |") if cuda else ("", "")
    print("| dtype | batch | base linears ms | add_lora gather ms | add_lora segments ms |" + extra[0])
    print("| --- | --- | ---: | ---: | ---: |" + extra[1])
    decode = [(i % args.adapters, 1) for i in range(args.tokens)]
    per = args.prefill // args.prefill_segments
    prefill = [(i % args.adapters, per) for i in range(args.prefill_segments)]
    for dtype in (torch.bfloat16, torch.float32):
        for name, runs in ((f"decode {args.tokens}x1, {args.adapters} adapters", decode),
                           (f"prefill {args.prefill_segments}x{per}", prefill)):  # fmt: skip
            tokens = sum(n for _, n in runs)
            base_step, lora_step = model_calls(tokens, args.adapters, args.rank, dtype, device, targets)
            batch = LoRABatch.from_runs(runs, device)
            # Both torch strategies whatever the threshold picks (on CUDA both read as the Triton path).
            steps: dict[str, Callable[[], object]] = {
                "base": base_step,
                "gather": lambda b=dataclasses.replace(batch, use_segments=False), f=lora_step: f(b),
                "segments": lambda b=dataclasses.replace(batch, use_segments=True), f=lora_step: f(b),
            }
            if cuda:
                steps["base graph"] = graphed(base_step)
                steps["lora graph"] = graphed(lambda b=batch, f=lora_step: f(b))
            ms = best_ms(steps, args.rounds, device)
            chosen = "segments" if batch.use_segments else "gather"
            graph_cols = f" {ms['base graph']:.2f} | {ms['lora graph']:.2f} |" if cuda else ""
            print(f"| {str(dtype).removeprefix('torch.')} | {name} (picks {chosen}) | {ms['base']:.1f} | "
                  f"{ms['gather']:.1f} | {ms['segments']:.1f} |{graph_cols}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
