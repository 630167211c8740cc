"""Decode inter-token latency on CPU with a JSON-schema grammar vs without, in the same run.

The ~56M-parameter random Llama of ``engine_cpu.py`` (vocab 32000, fp32) decodes a batch of ``--batch``
requests with the same prompt length; in the guided run every request carries a JSON schema (compiled
once, cached), in the plain run none does. The engine is stepped directly and each step is timed; the ITL
is the step time of decode steps in which the whole batch is decoding (every request gets one token per
such step), so both systems are compared at the same batch size. ``--repeats`` alternates the two and
keeps each one's best median. Usage: ``python benchmarks/grammar_itl_cpu.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt, markdown_table, percentile, progress
from benchmarks.engine_cpu import build_model
from gpu_workers.engine import LLM, GuidedDecoding, SamplingParams
from gpu_workers.engine.guided import matcher as guided_matcher


class GrammarClock:
    """Time spent in the grammar's own work (filling and applying the batch mask, advancing matchers)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        mask, accept = guided_matcher.grammar_bitmask, guided_matcher.GuidedState.accept

        def timed_mask(*a, **kw):
            start = time.perf_counter()
            try:
                return mask(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start

        def timed_accept(state, token):
            start = time.perf_counter()
            try:
                return accept(state, token)
            finally:
                self.seconds += time.perf_counter() - start

        apply = guided_matcher.TokenBitmask.apply

        def timed_apply(bitmask, logits):
            start = time.perf_counter()
            try:
                return apply(bitmask, logits)
            finally:
                self.seconds += time.perf_counter() - start

        guided_matcher.grammar_bitmask = timed_mask
        guided_matcher.TokenBitmask.apply = timed_apply
        guided_matcher.GuidedState.accept = timed_accept


SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    },
    "required": ["title", "items"],
}


CLOCK = GrammarClock()
# Mean grammar work per step (ms) of the latest run, by guided or not.
GRAMMAR_MS: dict[bool, float] = {}


def decode_step_times(llm: LLM, batch: int, prompt_len: int, max_tokens: int, guided: bool) -> list[float]:
    """Step times (s) of the steps in which all ``batch`` requests decode together."""
    engine = llm.engine
    for i in range(batch):
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=not guided,
            guided=GuidedDecoding(json_schema=SCHEMA) if guided else None,
        )
        engine.add_request([3 + (i * 7 + j) % 500 for j in range(prompt_len)], params)
    times = []
    CLOCK.seconds = 0.0
    steps = 0
    while engine.has_unfinished():
        decoding = sum(1 for s in engine.scheduler.running if s.num_computed_tokens + 1 == s.num_tokens)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        steps += 1
        if decoding == batch and not engine.scheduler.waiting:
            times.append(elapsed)
    GRAMMAR_MS[guided] = CLOCK.seconds / steps * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", args.quick)
        llm = LLM(str(path), max_model_len=1024, num_kv_blocks=1024, max_num_seqs=args.batch)
        # Warm up both paths (the grammar compile happens here, once, as it would for a cached schema).
        for guided in (False, True):
            decode_step_times(llm, args.batch, args.prompt_len, 8, guided)
        best: dict[str, list[float]] = {}
        grammar_ms: dict[str, float] = {}
        for r in range(args.repeats):
            for name, guided in (("none", False), ("json_schema", True)):
                progress(f"repeat {r + 1}/{args.repeats}: {name}")
                times = decode_step_times(llm, args.batch, args.prompt_len, args.max_tokens, guided)
                if name not in best or statistics.median(times) < statistics.median(best[name]):
                    best[name] = times
                    grammar_ms[name] = GRAMMAR_MS[guided]
    base = statistics.median(best["none"])
    rows = []
    for name, times in best.items():
        med = statistics.median(times)
        rows.append(
            [
                name,
                str(len(times)),
                fmt(med * 1e3, 2),
                fmt(percentile(times, 0.9) * 1e3, 2),
                f"{med / base:.3f}x",
                fmt(grammar_ms[name], 3),
            ]
        )
    print(f"batch {args.batch}, prompt {args.prompt_len}, up to {args.max_tokens} tokens, {args.threads} threads")
    print(
        markdown_table(
            ["grammar", "decode steps", "ITL p50 (ms)", "ITL p90 (ms)", "vs none", "grammar work per step (ms)"], rows
        )
    )


if __name__ == "__main__":
    main()
