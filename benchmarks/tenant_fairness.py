"""Two tenants, one sending prompts 8x longer, through the worker's intake and one engine: each tenant's token share.

One Kafka partition is modelled as a list in arrival order: tenants A (prompts ``8 x --short-prompt`` tokens) and B
(``--short-prompt``) publish alternately at the same request rate, open loop, at ``--load`` x what the engine
serves, so both build a backlog. The worker's intake takes records off it as the worker does, and the engine (the
tiny random Llama of :mod:`benchmarks.deadlines`, ``--max-num-seqs`` seats, its own per-tenant fair queuing on)
serves them. The same arrivals run through each intake, in the same run:

* ``kafka order``: the intake without fairness across tenants: records start in partition order while fewer
  than ``--lookahead`` are started (the engine orders only those by tenant);
* ``fair intake, hold N``: :class:`gpu_workers.worker.fair_intake.FairIntake` driven as the worker's intake drives
  it: up to N records fetched past what runs, started tenant by tenant by tokens (prompt + max_tokens charged at
  the start, settled to what was used), within the same ``--lookahead``.

Tokens are counted per tenant as the engine computes them (a prompt's tokens when its first token comes out, then
each output token) over the arrival window, while both tenants have a backlog. Time is counted in engine steps, so
the figures do not depend on how busy a shared box is (wall seconds are printed too). The headline is B's tokens
over A's (1.0 is an equal share; target within 10 %).

Usage: ``python benchmarks/tenant_fairness.py`` (under a minute on 2 cores) or ``--json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, markdown_table
from benchmarks.deadlines import tiny_engine
from gpu_workers.engine import LLMEngine, SamplingParams
from gpu_workers.worker.fair_intake import FairIntake, Held

TENANTS = ("A", "B")


@dataclass(frozen=True)
class Arrival:
    request_id: str
    tenant: str
    arrival_step: int
    prompt: list[int]
    output_tokens: int


def workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    """Alternating A and B at ``--load`` x the engine's capacity in requests (seats / steps a request holds one)."""
    rng = random.Random(args.seed)
    gap = (args.output + 1) / args.max_num_seqs / args.load  # steps between arrivals
    arrivals = []
    for i in range(2 * args.requests):
        tenant = TENANTS[i % 2]
        length = args.short_prompt * (args.ratio if tenant == "A" else 1)
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        arrivals.append(Arrival(f"{tenant}-{i}", tenant, int(i * gap), prompt, args.output))
    return arrivals


def run(
    engine: LLMEngine, arrivals: list[Arrival], lookahead: int, hold: int | None, warmup: float = 0.25
) -> dict[str, Any]:
    """Serve ``arrivals`` through one intake (``hold`` None: Kafka order) until the last one is published; tokens
    computed and requests started per tenant from the first ``warmup`` of that window on (the queues are still
    short at first, and the engine's start is the same for both intakes)."""
    log: deque[Arrival] = deque()
    pending = deque(arrivals)
    fair: FairIntake[Arrival] = FairIntake()
    started: dict[str, tuple[Arrival, Held[Arrival] | None]] = {}
    first_seen: set[str] = set()
    tokens = dict.fromkeys(TENANTS, 0)
    starts = dict.fromkeys(TENANTS, 0)
    end = arrivals[-1].arrival_step + 1
    counted_from = int(warmup * end)
    wall = time.perf_counter()

    def start(arrival: Arrival, held: Held[Arrival] | None, step: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=arrival.output_tokens, ignore_eos=True)
        engine.add_request(arrival.prompt, params, request_id=arrival.request_id, tenant=arrival.tenant)
        started[arrival.request_id] = (arrival, held)
        if step >= counted_from:
            starts[arrival.tenant] += 1

    for step in range(end):
        while pending and pending[0].arrival_step <= step:
            log.append(pending.popleft())
        if hold is None:
            while len(started) < lookahead and log:
                start(log.popleft(), None, step)
        else:
            while fair.held("standard") < hold and log:
                a = log.popleft()
                fair.push("standard", a, a.tenant, len(a.prompt) + a.output_tokens)
            while len(started) < lookahead and (held := fair.pop("standard")) is not None:
                start(held.item, held, step)
        if not engine.has_unfinished():
            continue
        for delta in engine.step():
            arrival, held = started[delta.request_id]
            counted = step >= counted_from
            if delta.request_id not in first_seen:
                first_seen.add(delta.request_id)
                tokens[arrival.tenant] += len(arrival.prompt) if counted else 0
            tokens[arrival.tenant] += len(delta.token_ids) if counted else 0
            if delta.finished:
                del started[delta.request_id]
                if held is not None:
                    fair.settle(held, len(arrival.prompt) + arrival.output_tokens)
    wall_s = time.perf_counter() - wall
    for request_id in list(started):  # the next run starts from an idle engine
        engine.abort(request_id)
    backlog = len(log) + len(fair)
    return {
        "tokens": tokens,
        "starts": starts,
        "b_over_a": tokens["B"] / max(1, tokens["A"]),
        "steps": end,
        "counted_from": counted_from,
        "backlog_at_end": backlog,
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="per tenant")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--lookahead", type=int, default=0, help="records started at most; 0: 4 x max-num-seqs")
    parser.add_argument(
        "--holds", type=int, nargs="+", default=[1, 4, 8, 16], help="fair-intake holds to run, in x lookahead"
    )
    parser.add_argument("--load", type=float, default=2.0, help="arrival rate over the engine's capacity")
    parser.add_argument("--short-prompt", type=int, default=16, help="tenant B's prompt tokens")
    parser.add_argument("--ratio", type=int, default=8, help="tenant A's prompts over B's")
    parser.add_argument("--output", type=int, default=16, help="output tokens of every request")
    parser.add_argument("--warmup", type=float, default=0.25, help="share of the window not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    lookahead = args.lookahead or 4 * args.max_num_seqs
    results: dict[str, dict[str, Any]] = {}
    with tiny_engine(args.max_num_seqs) as engine:
        arrivals = workload(args, engine.vocab_size)
        results["kafka order"] = run(engine, arrivals, lookahead, None, args.warmup)
        for times in args.holds:
            name = f"fair intake, hold {times * lookahead}"
            results[name] = run(engine, arrivals, lookahead, times * lookahead, args.warmup)
    if args.json:
        print(json.dumps({"args": vars(args) | {"lookahead": lookahead}, "results": results}, indent=2))
        return
    rows = []
    for name, r in results.items():
        total = sum(r["tokens"].values())
        rows.append(
            [
                name,
                str(r["tokens"]["A"]),
                str(r["tokens"]["B"]),
                f"{100 * r['tokens']['A'] / total:.1f} %",
                f"{100 * r['tokens']['B'] / total:.1f} %",
                f"{r['b_over_a']:.2f}",
                f"{r['starts']['A']}/{r['starts']['B']}",
                str(r["backlog_at_end"]),
                fmt(r["wall_s"], 1),
            ]
        )
    header = [
        "intake", "A tokens", "B tokens", "A share", "B share", "B / A", "started A/B", "backlog at end", "wall s",
    ]  # fmt: skip
    print(markdown_table(header, rows))
    print(
        f"\n{2 * args.requests} requests over {results['kafka order']['steps']} steps (counted from step "
        f"{results['kafka order']['counted_from']}), lookahead {lookahead}, "
        f"A's prompts {args.ratio}x B's ({args.ratio * args.short_prompt} vs {args.short_prompt} tokens), "
        f"{args.output} output tokens each; B / A = 1.0 is an equal token share (target within 10 %)"
    )


if __name__ == "__main__":
    main()
