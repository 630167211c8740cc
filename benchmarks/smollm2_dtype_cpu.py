"""Decode speed of the default model (SmolLM2-135M-Instruct, dequantized from its Q4_1 GGUF) on this CPU in
float32 and bfloat16: batch 1, greedy, a fixed number of new tokens, best of a few runs, dtypes interleaved so a
busy machine slows both alike. ``sluicegate up`` serves the default model in the faster one
(``sluicegate.stack.launcher.default_model_dtype``).

    python -m benchmarks.smollm2_dtype_cpu [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_MODELS = Path(__file__).resolve().parent.parent / ".sluicegate" / "models"
DTYPES = ("float32", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    from gpu_workers.engine import LLM, SamplingParams
    from sluicegate.models.smollm2 import fetch_smollm2

    path = fetch_smollm2(REPO_MODELS)
    engines = {d: LLM(str(path), dtype=d, max_model_len=512, num_kv_blocks=64) for d in DTYPES}
    encoded = engines["float32"].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about rivers."}], add_generation_prompt=True, tokenize=True
    )
    prompt = [int(i) for i in (encoded if isinstance(encoded, list) else encoded["input_ids"])]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    best = dict.fromkeys(DTYPES, float("inf"))
    for llm in engines.values():
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
    for _ in range(args.rounds):
        for dtype, llm in engines.items():
            started = time.perf_counter()
            llm.generate([prompt], params)
            best[dtype] = min(best[dtype], time.perf_counter() - started)
    print(
        f"SmolLM2-135M-Instruct, batch 1, {len(prompt)}-token prompt + {args.tokens} tokens, "
        f"{torch.get_num_threads()} threads, best of {args.rounds}"
    )
    print("| dtype | tokens/s |\n| --- | --- |")
    for dtype in DTYPES:
        print(f"| {dtype} | {args.tokens / best[dtype]:.1f} |")
    print(f"bfloat16 / float32: {best['float32'] / best['bfloat16']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
