"""N-gram speculative decoding against plain decoding on CPU, same model, same requests, same run.

Model: a random ~56M-parameter Llama (hidden 512, 8 layers, vocab 32000, fp32), as in ``engine_cpu.py``. A random
model does not naturally quote its prompt, so the repetitive workload is built from the model's own output, the
way an edit / rewrite request repeats its source: for each random prompt P, the plain engine first generates its
greedy continuation O (``--output-tokens`` tokens); the measured prompt is ``P + O + P``, so a model that continues
as before reproduces O, and the n-gram proposer finds it in the prompt. Whether the target really repeats O is up
to the model: the acceptance rate printed is measured, not assumed. ``--workload random`` runs plain random prompts
instead (no built-in repetition; whatever loops the random model falls into are all the proposer gets).

Each request generates ``--output-tokens`` greedy tokens (EOS ignored); ``--batch`` requests run at once. Plain
and speculative engines run alternately ``--repeats`` times (the box may be shared) and each keeps its best wall
time. Both outputs are checked equal token for token. Usage: ``python benchmarks/spec_decode_cpu.py`` or
``--quick``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.random_checkpoint import make_tiny_model


def build_model(out_dir: Path, quick: bool) -> Path:
    if quick:
        return make_tiny_model(out_dir, arch="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                               vocab_size=2048, init_std=0.02)  # fmt: skip
    return make_tiny_model(out_dir, arch="llama", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                           vocab_size=32000, init_std=0.02)  # fmt: skip


def make_prompts(plain: LLM, args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    if args.workload == "random":
        return prompts
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    outputs = plain.generate(prompts, params)  # type: ignore[arg-type]
    return [p + o.token_ids + p for p, o in zip(prompts, outputs, strict=True)]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)  # type: ignore[arg-type]
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", choices=["repeat", "random"], default="repeat")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", args.quick)
        common = dict(max_model_len=2048, max_num_seqs=64, seed=0)
        plain = LLM(str(path), **common)  # type: ignore[arg-type]
        spec_config = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
        spec = LLM(str(path), speculative_config=spec_config, **common)  # type: ignore[arg-type]
        prompts = make_prompts(plain, args, plain.engine.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        warm = [p[:16] for p in prompts[:2]]
        plain.generate(warm, SamplingParams(max_tokens=4))  # type: ignore[arg-type]
        spec.generate(warm, SamplingParams(max_tokens=4))  # type: ignore[arg-type]
        best = {"plain": float("inf"), "ngram": float("inf")}
        tokens = args.batch * args.output_tokens
        before = spec.engine.stats()
        for _ in range(args.repeats):
            wall_plain, out_plain = timed(plain, prompts, params)
            wall_spec, out_spec = timed(spec, prompts, params)
            if out_plain != out_spec:
                raise SystemExit("speculative greedy output differs from plain greedy output")
            best["plain"] = min(best["plain"], wall_plain)
            best["ngram"] = min(best["ngram"], wall_spec)
        stats = spec.engine.stats()
        drafts = stats.spec_num_drafts - before.spec_num_drafts
        draft_tokens = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    print(
        f"workload={args.workload} batch={args.batch} prompt={len(prompts[0])} tokens output={args.output_tokens} "
        f"k={args.num_speculative_tokens} threads={args.threads} repeats={args.repeats}"
    )
    for name, wall in best.items():
        print(f"{name:6s} {tokens / wall:8.1f} tok/s  (best wall {wall:.2f} s)")
    print(f"speedup ngram/plain: {best['plain'] / best['ngram']:.2f}x")
    if draft_tokens:
        print(
            f"acceptance rate {accepted / draft_tokens:.2f} ({accepted}/{draft_tokens} drafts), mean accepted length "
            f"{1 + accepted / drafts:.2f} tokens per verification step, {drafts} verification steps"
        )
    else:
        print("no drafts were proposed")


if __name__ == "__main__":
    main()
