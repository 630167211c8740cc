"""The deterministic mode on the default model (SmolLM2-135M-Instruct's Q4_1 GGUF): does an answer depend on its
company, and what does the mode cost?

``check``: 12 chat prompts, each first generated alone, then all 24 (each twice) in one batch, greedy and seeded
(temperature 0.8); counts the replies of the batch that differ from the same prompt alone. The batch is run with
chunked prefill forced (a small ``max_num_batched_tokens``), prefix-cache hits (every prompt twice) and, with
``--preempt``, a KV cache small enough that sequences are preempted and recomputed.

``cost``: ITL (median gap between a request's tokens) and decode tok/s at concurrency 1 and 8, mode off and on,
the two interleaved round by round so a busy machine slows them alike; best round of each.

    python -m benchmarks.determinism check [--dtype bfloat16 --quantization cpu-int4] [--deterministic] [--preempt]
    python -m benchmarks.determinism cost [--rounds 3] [--tokens 48] [--device cuda --model DIR --quantization ''
                                           --out determinism.json]

``--model`` names another checkpoint (the GPU run's random one: benchmarks/gpu_run.sh's determinism phase) and
``--device cuda`` runs the mode's Triton kernels (execution/batch_invariant_triton.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gpu_workers.engine import LLM, SamplingParams
from sluicegate.models.smollm2 import fetch_smollm2

REPO_MODELS = Path(__file__).resolve().parent.parent / ".sluicegate" / "models"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "List two uses of a paperclip.",
    "What does a compiler do?",
    "Suggest a name for a friendly robot.",
]


def chat_ids(llm: LLM, question: str) -> list[int]:
    if not getattr(llm.tokenizer, "chat_template", None):  # a random benchmark checkpoint's bare tokenizer
        return [int(i) for i in llm.tokenizer.encode(question)]
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]


def make_llm(args: argparse.Namespace, deterministic: bool, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = dict(
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization or None,
        max_model_len=1024,
        deterministic=deterministic,
        lm_head_quantization=args.lm_head_quantization or None,
        cpu_int4_activations=args.cpu_int4_activations,
        # As `up` serves on the CPU; under the mode every step, prompt tokens too, then runs through the graph.
        compile_cpu_decode=args.compile_cpu_decode,
    )
    if args.device == "cuda":  # two engines (mode off and on) share the GPU
        kwargs["gpu_memory_utilization"] = 0.4
    kwargs.update(overrides)
    return LLM(args.model or str(fetch_smollm2(REPO_MODELS)), **kwargs)


def check(args: argparse.Namespace) -> None:
    # Alone: a roomy engine, one prompt at a time. Together: chunked prefill, every prompt twice (the second copy's
    # prompt from the prefix cache), and with --preempt a cache that cannot hold the batch.
    alone_llm = make_llm(args, args.deterministic)
    prompts = [chat_ids(alone_llm, q) for q in QUESTIONS]
    modes = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.tokens, seed=7, ignore_eos=True),
    }
    alone = {name: [alone_llm.generate([p], sp)[0].token_ids for p in prompts] for name, sp in modes.items()}
    alone_llm.engine.close()
    together_kwargs: dict[str, Any] = {"max_num_batched_tokens": 32}
    if args.preempt:
        together_kwargs["num_kv_blocks"] = 64  # 1024 tokens: max_model_len, far less than 24 prompts need
    together_llm = make_llm(args, args.deterministic, **together_kwargs)
    for name, sp in modes.items():
        outs = together_llm.generate(prompts + prompts, sp)
        differ = sum(out.token_ids != alone[name][i % len(prompts)] for i, out in enumerate(outs))
        print(
            f"{args.dtype}{' ' + args.quantization if args.quantization else ''}, deterministic={args.deterministic},"
            f" preempt={args.preempt}, {name}: {differ} of {len(outs)} replies differ from the prompt alone",
            flush=True,
        )
    together_llm.engine.close()


def _run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(median inter-token latency in ms, decode tok/s) of the prompts generated concurrently."""
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p in prompts]
    times: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.token_ids:
                times[delta.request_id].append(time.perf_counter())
    gaps = [b - a for t in times.values() for a, b in itertools.pairwise(t[1:])]
    span = max(t[-1] for t in times.values()) - min(t[1] for t in times.values())
    return 1000 * statistics.median(gaps), (tokens - 2) * len(prompts) / span


def cost(args: argparse.Namespace) -> None:
    llms = {mode: make_llm(args, mode) for mode in (False, True)}
    prompts = [chat_ids(llms[False], q) for q in QUESTIONS]
    best: dict[tuple[bool, int], tuple[float, float]] = {}
    for _ in range(args.rounds):
        for c in (1, 8):
            for mode, llm in llms.items():
                itl, tps = _run(llm, prompts[:c], args.tokens)
                old = best.get((mode, c))
                best[(mode, c)] = (min(itl, old[0]), max(tps, old[1])) if old else (itl, tps)
    rows = []
    for c in (1, 8):
        (off_itl, off_tps), (on_itl, on_tps) = best[(False, c)], best[(True, c)]
        rows.append(dict(c=c, itl_ms_off=off_itl, itl_ms_on=on_itl, itl_ratio=on_itl / off_itl, tok_s_off=off_tps,
                         tok_s_on=on_tps, tok_s_ratio=off_tps / on_tps))  # fmt: skip
        print(
            f"c={c}: ITL {off_itl:.1f} -> {on_itl:.1f} ms ({on_itl / off_itl:.2f}x), "
            f"{off_tps:.1f} -> {on_tps:.1f} tok/s ({off_tps / on_tps:.2f}x slower)",
            flush=True,
        )
    if args.out is not None:
        machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        doc = dict(device=args.device, machine=machine, dtype=args.dtype,
                   quantization=args.quantization, tokens=args.tokens, rounds=args.rounds,
                   date=time.strftime("%Y-%m-%d"), cost=rows)  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for llm in llms.values():
        llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("check", "cost"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="cpu-int4", help="empty for the dequantized model")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--preempt", action="store_true")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="", help="a checkpoint folder or GGUF instead of SmolLM2's GGUF")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None, help="cost: write the figures here as JSON")
    parser.add_argument("--compile-cpu-decode", action="store_true", help="decode steps compiled, as `up` serves")
    parser.add_argument("--lm-head-quantization", default="", help="w8a8: the LM head as `up` serves it on the CPU")
    parser.add_argument(
        "--cpu-int4-activations",
        default="auto",
        help="the 4-bit layers' activations: auto (int8 where torch dispatches to AVX2, as `up` serves), int8, "
        "bfloat16",
    )
    args = parser.parse_args()
    (check if args.what == "check" else cost)(args)


if __name__ == "__main__":
    main()
