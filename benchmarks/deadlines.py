"""Earliest-deadline-first against FIFO on an overloaded engine, same model, same requests, same run.

One ``LLMEngine`` (a tiny random Llama on CPU, ``--max-num-seqs`` seats) gets an open-loop stream of requests at
about twice the rate it can serve (``--load``), so a queue builds up. Requests come in three kinds, shuffled:
``tight`` (must finish within ``--tight-slack`` x their own service time of arriving), ``loose`` (``--loose-slack``
x) and ``none`` (no deadline). The same arrivals run twice: FIFO (the engine is given no deadlines: one tenant, so
arrival order) and EDF (each request's deadline handed to the engine, ``EngineRequest.deadline``). Time is counted
in engine steps, so the figures do not depend on how busy a shared box is (wall seconds are printed too); a
request "meets" its deadline when its last token comes out at or before it. The headline is the share of requests
with a deadline that met it, EDF over FIFO (target >= 1.5x), with what it costs the requests without a deadline.

Usage: ``python benchmarks/deadlines.py`` (well under a minute on 2 cores) or ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, markdown_table, percentile
from gpu_workers.engine import EngineConfig, LLMEngine, SamplingParams
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

KINDS = ("tight", "loose", "none")


@dataclass(frozen=True)
class Arrival:
    request_id: str
    kind: str
    arrival_step: int
    prompt: list[int]
    output_tokens: int
    deadline_step: float | None  # finish by this step; None: no deadline


@contextlib.contextmanager
def tiny_engine(max_num_seqs: int, max_model_len: int = 512) -> Iterator[LLMEngine]:
    """The benchmarks' engine: a tiny random Llama on CPU, one thread (shared with benchmarks.tenant_fairness)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "tiny", arch="llama")
        yield LLMEngine(EngineConfig(str(path), max_model_len=max_model_len, max_num_seqs=max_num_seqs))


def workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    """Open-loop arrivals at ``--load`` x the engine's capacity (seats / mean steps per request)."""
    rng = random.Random(args.seed)
    mean_steps = (args.min_output + args.max_output) / 2 + 1  # a prefill step plus one step per token
    gap = mean_steps / args.max_num_seqs / args.load  # steps between arrivals
    kinds = [KINDS[i % len(KINDS)] for i in range(args.requests)]
    rng.shuffle(kinds)
    arrivals = []
    for i, kind in enumerate(kinds):
        step = int(i * gap)
        out = rng.randint(args.min_output, args.max_output)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))]
        slack = {"tight": args.tight_slack, "loose": args.loose_slack}.get(kind)
        deadline = None if slack is None else step + slack * (out + 1)
        arrivals.append(Arrival(f"{kind}-{i}", kind, step, prompt, out, deadline))
    return arrivals


def run(engine: LLMEngine, arrivals: list[Arrival], edf: bool) -> tuple[dict[str, int], float]:
    """Step the engine through the arrivals; each request's finishing step, and the wall time taken."""
    pending = sorted(arrivals, key=lambda a: a.arrival_step)
    finished: dict[str, int] = {}
    step = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            a = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=a.output_tokens, ignore_eos=True)
            # The engine only orders by the deadline, so steps serve as its clock here.
            deadline = a.deadline_step if edf else None
            engine.add_request(a.prompt, params, request_id=a.request_id, deadline=deadline)
        if engine.has_unfinished():
            for delta in engine.step():
                if delta.final is not None:
                    finished[delta.request_id] = step
        step += 1
    return finished, time.perf_counter() - started


def summarize(arrivals: list[Arrival], finished: dict[str, int]) -> dict[str, Any]:
    by_kind: dict[str, Any] = {}
    for kind in KINDS:
        group = [a for a in arrivals if a.kind == kind]
        latency = [finished[a.request_id] - a.arrival_step for a in group]
        met = [a for a in group if a.deadline_step is not None and finished[a.request_id] <= a.deadline_step]
        by_kind[kind] = {
            "requests": len(group),
            "met": len(met) if kind != "none" else None,
            "p50_steps": percentile(latency, 0.5),
            "p99_steps": percentile(latency, 0.99),
        }
    with_deadline = [a for a in arrivals if a.deadline_step is not None]
    met_all = sum(1 for a in with_deadline if finished[a.request_id] <= a.deadline_step)  # type: ignore[operator]
    return {"kinds": by_kind, "met_share": met_all / len(with_deadline), "steps": max(finished.values()) + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--load", type=float, default=2.0, help="arrival rate over the engine's capacity")
    parser.add_argument("--min-output", type=int, default=4)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--tight-slack", type=float, default=3.0, help="x the request's own service steps")
    parser.add_argument("--loose-slack", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tiny_engine(args.max_num_seqs) as engine:
        arrivals = workload(args, engine.vocab_size)
        results = {}
        for name, edf in (("FIFO", False), ("EDF", True)):
            finished, wall_s = run(engine, arrivals, edf)
            results[name] = summarize(arrivals, finished) | {"wall_s": wall_s}
    ratio = results["EDF"]["met_share"] / max(results["FIFO"]["met_share"], 1e-9)
    if args.json:
        print(json.dumps({"args": vars(args), "results": results, "edf_over_fifo": ratio}, indent=2))
        return
    rows = []
    for name, r in results.items():
        kinds = r["kinds"]
        rows.append(
            [
                name,
                f"{100 * r['met_share']:.1f} %",
                f"{kinds['tight']['met']}/{kinds['tight']['requests']}",
                f"{kinds['loose']['met']}/{kinds['loose']['requests']}",
                fmt(kinds["tight"]["p50_steps"], 0),
                fmt(kinds["none"]["p50_steps"], 0),
                fmt(kinds["none"]["p99_steps"], 0),
                str(r["steps"]),
                fmt(r["wall_s"], 2),
            ]
        )
    header = [
        "order", "met deadline", "tight met", "loose met", "tight p50 (steps)", "no-deadline p50", "no-deadline p99",
        "steps", "wall s",
    ]  # fmt: skip
    print(markdown_table(header, rows))
    print(f"\nEDF / FIFO, share of requests with a deadline that met it: {ratio:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
