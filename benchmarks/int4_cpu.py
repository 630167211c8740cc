"""INT4 (AWQ / GPTQ) checkpoints on CPU: weight memory against bf16, and decode speed for the record.

A random Llama (hidden 1024, 4 layers, 16 heads / 4 KV heads, MLP 2816, vocab 2048) is written in
fp32, then as AWQ and GPTQ INT4 checkpoints (group size 128, random packed values:
``benchmarks/int4_checkpoint.py``). Figures:

* memory: bytes of the projections (q/k/v/o/gate/up/down; embeddings and LM head stay float) as the
  engine holds them, INT4 (packed values, byte zero points, bf16 scales) over the bf16 model's,
  both loaded with ``dtype=bfloat16``; the whole model's ratio too;
* decode: output tokens/s of ``--batch`` greedy requests (16-token prompts, ``--tokens`` new tokens
  each, EOS ignored) for the fp32 model and the INT4 ones (the torch fallback: each projection is
  dequantized per call; the Triton kernel is the GPU path), interleaved ``--repeats`` times, best kept.

Usage: ``PYTHONPATH=. python3 benchmarks/int4_cpu.py [--threads 1] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.int4_checkpoint import write_random_int4
from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.quantization import weight_memory_bytes

_PROJ_SUFFIXES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def projection_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of the projection layers, bytes of the whole model) as loaded."""
    model = llm.engine.loaded.model
    proj = sum(weight_memory_bytes(m) for name, m in model.named_modules() if name.endswith(_PROJ_SUFFIXES))
    return proj, weight_memory_bytes(model)


def decode_tok_s(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [[3 + (7 * i + j) % 2000 for j in range(16)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        float_dir = make_tiny_model(root / "fp", arch="llama", num_layers=4, hidden_size=1024, num_heads=16,
                                    num_kv_heads=4, intermediate_size=2816, vocab_size=2048, init_std=0.02)  # fmt: skip
        dirs = {"fp32": float_dir, **{m: write_random_int4(float_dir, root / m, m) for m in ("awq", "gptq")}}
        kwargs = {"max_model_len": 256, "num_kv_blocks": 64}

        bf16_proj, bf16_all = projection_bytes(LLM(str(float_dir), dtype="bfloat16", **kwargs))
        print("\n| weights (dtype=bfloat16) | projections MiB | ratio to bf16 | whole model MiB | ratio |")
        print("|---|---|---|---|---|")
        print(f"| bf16 | {bf16_proj / 2**20:.2f} | 1.00x | {bf16_all / 2**20:.2f} | 1.00x |")
        for method in ("awq", "gptq"):
            proj, whole = projection_bytes(LLM(str(dirs[method]), dtype="bfloat16", **kwargs))
            print(f"| {method} INT4 g128 | {proj / 2**20:.2f} | {proj / bf16_proj:.3f}x | "
                  f"{whole / 2**20:.2f} | {whole / bf16_all:.3f}x |")  # fmt: skip

        engines = {name: LLM(str(path), **kwargs) for name, path in dirs.items()}
        for llm in engines.values():
            decode_tok_s(llm, args.batch, 4)  # warm-up
        best = dict.fromkeys(engines, 0.0)
        for _ in range(args.repeats):
            for name, llm in engines.items():  # interleaved, so a load spike hits every system
                best[name] = max(best[name], decode_tok_s(llm, args.batch, args.tokens))
        print(f"\n| decode ({args.batch} x {args.tokens} tokens, {args.threads} thread(s)) | tok/s | ratio to fp32 |")
        print("|---|---|---|")
        for name, tok_s in best.items():
            print(f"| {name} | {tok_s:.1f} | {tok_s / best['fp32']:.2f}x |")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
