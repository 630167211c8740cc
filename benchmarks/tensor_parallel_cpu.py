"""Tensor parallelism on CPU, for the record: 2 ranks under gloo against 1, same model, same requests.

Model: the random ~56M-parameter Llama of ``engine_cpu.py`` (hidden 512, 8 layers, 8 heads / 4 KV heads, vocab
32000, fp32). ``--batch`` random prompts of ``--prompt-tokens`` tokens, ``--output-tokens`` greedy tokens each
(EOS ignored), all submitted at once. Rows: TP=1 with 1 torch thread, TP=1 with 2 threads (the same two cores
TP=2 uses), TP=2 with 1 thread per rank. Each engine runs ``--repeats`` times and keeps its best wall time; the
greedy outputs of all three are checked equal. On two CPU cores TP buys nothing that two threads do not: every
layer adds two all-reduces through gloo's TCP loopback. It is here to show the mechanism's cost; the GPU run
(``engine_gpu.py``) is the one that matters.

Usage: ``python benchmarks/tensor_parallel_cpu.py`` (a couple of minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spec_decode_cpu import generate_greedy
from gpu_workers.engine import EngineConfig, LLMEngine
from gpu_workers.engine.models.random_checkpoint import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "m", arch="llama", num_layers=8, hidden_size=512, num_heads=8,
                               num_kv_heads=4, vocab_size=32000, init_std=0.02)  # fmt: skip
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
        outputs = {}
        for label, threads, tp in (("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 2, 1), ("TP=2, 1 thread/rank", 1, 2)):
            torch.set_num_threads(threads)  # rank 1 takes rank 0's thread count
            config = EngineConfig(str(path), max_model_len=512, max_num_seqs=64, tensor_parallel_size=tp)
            engine = LLMEngine(config)
            try:
                generate_greedy(engine, [p[:8] for p in prompts[:2]], 4)  # warm-up
                best = float("inf")
                for _ in range(args.repeats):
                    wall, out = generate_greedy(engine, prompts, args.output_tokens)
                    best = min(best, wall)
                outputs[label] = out
            finally:
                engine.close()
            print(f"{label}: {args.batch * args.output_tokens / best:.1f} tok/s (best of {args.repeats}: {best:.2f} s)")
        first = next(iter(outputs.values()))
        print("greedy outputs equal:", all(out == first for out in outputs.values()))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
