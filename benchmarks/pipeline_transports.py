"""The pipeline benchmark's paired transport run (``--transports plain,secure``): what TLS + SCRAM on Kafka and
TLS + ACL users on Redis add to the pipeline's overhead, measured under the same load at the same time.

Both stacks run side by side for the whole run (each its own private Kafka, Redis, ingress, result service and
timed worker; ``pipeline_stack.py``). The measured time of each rate is cut into ``--rounds`` slices; in each
round every transport gets one slice with the same Poisson arrival schedule (same seed and label), and the order
alternates from round to round (plain, secure / secure, plain ...), so a neighbour's burst on the shared machine
falls on both alike. Each transport's slices are then analysed together as one level, as a single-transport run
analyses its rate, and the report sets their overhead side by side with the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.common import fmt, load_average, markdown_table, percentile, progress, use_uvloop
from benchmarks.pipeline_load import API_PATHS, Sample, run_rate
from benchmarks.pipeline_report import Level, analyse, latency_table, stage_table
from benchmarks.pipeline_stack import Stack, start_stack

TRANSPORTS = ("plain", "secure")
#: The feature's target: TLS (and SCRAM, ACL users) adds at most this much to the overhead p50 at this rate.
TARGET_RATE = 10.0
TARGET_P50_DELTA_MS = 1.0


def parse_transports(text: str) -> list[str]:
    """``plain``, ``secure`` or both, comma-separated, each once; ``ValueError`` naming what is wrong."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TRANSPORTS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--transports {text!r}: expected one or both of {', '.join(TRANSPORTS)}, each once")
    return names


def run_paired(
    args: argparse.Namespace, rates: list[float], workdir: Path, transports: list[str]
) -> list[tuple[str, Level]]:
    """Start one stack per transport, warm each up, run every rate in alternating rounds; return each transport's
    levels as ``[(transport, level), ...]`` in rate order, analysed with its worker's stamps."""
    stacks: dict[str, Stack] = {}
    try:
        for transport in transports:
            stacks[transport] = start_stack(args, workdir / transport, transport=transport)
        if args.warmup > 0:
            for transport, stack in stacks.items():
                progress(f"warm-up {transport}: {args.warmup:g} s at {args.warmup_rate:g} req/s ...")
                asyncio.run(
                    run_rate(stack, args.warmup_rate, args.warmup, max_tokens=args.max_tokens, seed=args.seed,
                             label="warm ", api=args.api)
                )  # fmt: skip
        samples: dict[tuple[str, float], list[Sample]] = {(t, r): [] for t in transports for r in rates}
        slice_s = args.duration / args.rounds
        for rate in rates:
            progress(f"{rate:g} req/s: {args.rounds} rounds of {slice_s:g} s per transport ...")
            for round_no in range(args.rounds):
                order = transports if round_no % 2 == 0 else list(reversed(transports))
                for transport in order:
                    samples[(transport, rate)] += asyncio.run(
                        run_rate(stacks[transport], rate, slice_s, max_tokens=args.max_tokens, seed=args.seed,
                                 label=f"round {round_no} ", api=args.api)
                    )  # fmt: skip
                    stacks[transport].check_alive()
        levels: list[tuple[str, Level]] = []
        for transport, stack in stacks.items():
            recorded = stack.stop_worker()
            for rate in rates:
                level = Level(rate, args.duration, samples[(transport, rate)])
                analyse(level, recorded["stamps"])
                levels.append((transport, level))
        return levels
    finally:
        for stack in stacks.values():
            stack.close()


def transport_table(levels: list[tuple[str, Level]]) -> str:
    """Overhead p50 / p99 of each transport at each rate, and secure - plain with the target's verdict."""
    rows = []
    by_rate: dict[float, dict[str, Level]] = {}
    for transport, level in levels:
        by_rate.setdefault(level.rate, {})[transport] = level
    for rate, pair in by_rate.items():
        for transport, level in pair.items():
            overhead = level.series.get("overhead", [])
            rows.append([f"{rate:g}", transport, str(len(overhead)), fmt(percentile(overhead, 0.5)),
                         fmt(percentile(overhead, 0.99)), f"{len(level.errors)}", ""])  # fmt: skip
        if {"plain", "secure"} <= pair.keys():
            d50 = pair["secure"].p("overhead", 0.5) - pair["plain"].p("overhead", 0.5)
            d99 = pair["secure"].p("overhead", 0.99) - pair["plain"].p("overhead", 0.99)
            verdict = ("met" if d50 <= TARGET_P50_DELTA_MS else "missed") if rate == TARGET_RATE else ""
            ratio = pair["secure"].p("overhead", 0.5) / pair["plain"].p("overhead", 0.5)
            rows.append([f"{rate:g}", "secure - plain", "", f"{d50:+.2f} ({fmt(ratio)}x)", f"{d99:+.2f}", "", verdict])
    header = [
        "offered req/s",
        "transport",
        "n",
        "overhead p50 ms",
        "overhead p99 ms",
        "failed",
        f"target (secure adds <= {TARGET_P50_DELTA_MS:g} ms to p50 at {TARGET_RATE:g}/s)",
    ]
    return markdown_table(header, rows)


def report(levels: list[tuple[str, Level]]) -> str:
    """The paired run's tables: the comparison, then each transport's latency and stage tables."""
    parts = [
        "plain: PLAINTEXT Kafka, redis:// without a password. secure: SASL_SSL Kafka (SCRAM-SHA-512, TLS, the "
        "service user), rediss:// TLS-only Redis with each service's ACL user; same load, alternating rounds\n",
        transport_table(levels),
    ]
    for transport in dict.fromkeys(name for name, _ in levels):
        mine = [level for name, level in levels if name == transport]
        parts += [f"\n{transport}:\n", latency_table(mine), "\nwhere its overhead goes:\n", stage_table(mine)]
    return "\n".join(parts)


def main_paired(args: argparse.Namespace, rates: list[float], transports: list[str]) -> int:
    """``--transports plain,secure``: both stacks, alternating rounds, the comparison table."""
    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    load_before = load_average()
    try:
        levels = run_paired(args, rates, workdir, transports)
    finally:
        if args.keep:
            progress(f"logs and models kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\npipeline benchmark, transports paired, on {os.cpu_count()} CPUs (both stacks share them); load average "
        f"before: {load_before}; tiny random Llama on CPU; max_tokens {args.max_tokens}; API {API_PATHS[args.api]}; "
        f"{args.duration:g} s per rate and transport in {args.rounds} rounds; {args.partitions} partitions"
    )
    print(report(levels))
    return 1 if any(level.errors for _, level in levels) else 0
