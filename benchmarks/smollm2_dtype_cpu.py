"""Decode speed of the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF) on this CPU: dequantized to float32 or
bfloat16, or kept quantized (``gguf``: the file's Q4_1 blocks int4 and its Q8_0 LM head int8; ``cpu-int4``: the
blocks int4, the LM head bfloat16; ``cpu-int8``: per-channel int8; each with the model in bfloat16, and ``gguf``
also under a float32 model). Batch 1, greedy, a fixed number of new tokens, best of a few runs, the variants
interleaved so a busy machine slows them alike. ``sluicegate up`` serves the default model in the faster float
dtype (``cli.stack.launcher.default_model_dtype``).

Each variant's prefill is timed too: a ``--prefill-tokens`` prompt of fresh random token ids each round (so the
prefix cache never answers it), one new token. ``cpu-int4, kernel only`` is ``cpu-int4`` with its long-prefill
path turned off (``cpu_linear.DENSE_MIN_ROWS`` out of reach): every projection through the int4 kernel.

    python -m benchmarks.smollm2_dtype_cpu [--tokens 64] [--prefill-tokens 400] [--rounds 3] [--threads 2]
        [--variants float32 gguf]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO_MODELS = Path(__file__).resolve().parent.parent / ".sluicegate" / "models"
# name -> LLM keyword arguments
VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "gguf": {"quantization": "gguf"},
    "gguf, float32 model": {"dtype": "float32", "quantization": "gguf"},
    "cpu-int4": {"quantization": "cpu-int4"},
    "cpu-int4, float32 model": {"dtype": "float32", "quantization": "cpu-int4"},
    "cpu-int8": {"quantization": "cpu-int8"},
    "cpu-int4, kernel only": {"quantization": "cpu-int4"},
}
KERNEL_ONLY = frozenset({"cpu-int4, kernel only"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    import torch

    from gpu_workers.engine import LLM, SamplingParams
    from gpu_workers.engine.quantization import cpu_linear, weight_memory_bytes
    from sluicegate.models.smollm2 import fetch_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    path = fetch_smollm2(REPO_MODELS)
    engines = {v: LLM(str(path), max_model_len=1024, num_kv_blocks=128, **VARIANTS[v]) for v in args.variants}
    first = next(iter(engines.values()))
    encoded = first.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about rivers."}], add_generation_prompt=True, tokenize=True
    )
    prompt = [int(i) for i in (encoded if isinstance(encoded, list) else encoded["input_ids"])]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    best = dict.fromkeys(engines, float("inf"))
    best_prefill = dict.fromkeys(engines, float("inf"))
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    for llm in engines.values():
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
    dense_min_rows = cpu_linear.DENSE_MIN_ROWS
    for _ in range(args.rounds):
        for name, llm in engines.items():
            cpu_linear.DENSE_MIN_ROWS = 10**9 if name in KERNEL_ONLY else dense_min_rows
            started = time.perf_counter()
            llm.generate([prompt], params)
            best[name] = min(best[name], time.perf_counter() - started)
            long_prompt = [rng.randrange(1000, 40000) for _ in range(args.prefill_tokens)]
            started = time.perf_counter()
            llm.generate([long_prompt], one_token)
            best_prefill[name] = min(best_prefill[name], time.perf_counter() - started)
    load_after = os.getloadavg()
    print(
        f"SmolLM2-135M-Instruct, batch 1, {len(prompt)}-token prompt + {args.tokens} tokens, "
        f"{torch.get_num_threads()} threads, best of {args.rounds}; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    print(
        f"| variant | model dtype | weights MiB | tokens/s | prefill of {args.prefill_tokens} tokens ms |\n"
        "| --- | --- | ---: | ---: | ---: |"
    )
    for name, llm in engines.items():
        loaded = llm.engine.loaded
        mib = weight_memory_bytes(loaded.model) / 2**20
        dtype = str(loaded.dtype).removeprefix("torch.")
        print(f"| {name} | {dtype} | {mib:.0f} | {args.tokens / best[name]:.1f} | {best_prefill[name] * 1000:.0f} |")
    if "float32" in best and "bfloat16" in best:
        print(f"bfloat16 / float32: {best['float32'] / best['bfloat16']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
