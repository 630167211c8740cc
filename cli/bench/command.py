"""``sluicegate bench``: a load generator for any OpenAI-compatible endpoint, and for Sluicegate's own paths that no
other tool drives (the native API with its streams on one WebSocket, Kafka-native producers on ``llm.inbound``,
and a Batch API job).

The workload is the prompts of a JSONL dataset (``--dataset``; by default ``data/bench_prompts.jsonl`` shipped
beside this module, ~100 varied prompts) or synthetic prompts of ``--input-len`` words. Each run of a sweep sends
``--num-prompts`` requests either at a fixed concurrency (``--concurrency 1,8,32``: one run per level) or at a
Poisson arrival rate (``--rate 2,8``, requests per second; ``inf`` sends all at once), and reports TTFT, ITL,
TPOT and E2E latency percentiles, request and output-token throughput, and goodput: the requests per second that
met every SLO given (``--slo-ttft-ms``, ``--slo-itl-ms`` on the request's mean inter-token time as vLLM's goodput
does, ``--slo-e2e-ms``). The figures are printed as a table and written as JSON with ``--json FILE``.

The measures live in :mod:`cli.bench.measure`, the targets in :mod:`cli.bench.sweep`. Exit codes: 0 done; 1 a run
in which no request succeeded; 2 bad input (flags, dataset, unknown model); 3 the server, broker or Redis
unreachable.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from cli.bench.measure import BenchError


def _fail(message: str, code: int) -> NoReturn:
    print(f"sluicegate bench: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _bench(args: argparse.Namespace) -> int:
    try:
        from cli.bench.sweep import run_bench  # httpx, aiokafka and the targets load only when a bench runs

        return run_bench(args)
    except BenchError as exc:
        _fail(str(exc), exc.code)


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """Register ``sluicegate bench`` on the top-level subparsers."""
    bench = sub.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint, Kafka-native producers or a Batch API job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--target",
        choices=["openai", "native", "kafka", "batch"],
        default="openai",
        help="default openai; native: POST /requests, streams on one multiplexed WebSocket",
    )
    bench.add_argument("--base-url", help="OpenAI base URL (default: SLUICEGATE_API_BASE_URL or the local ingress)")
    bench.add_argument("--api-key", help="API key (default: OPENAI_API_KEY, then SLUICEGATE_API_KEY)")
    bench.add_argument(
        "--model", help="model name (default: the server's first model; --target kafka: SLUICEGATE_MODEL_NAME)"
    )
    bench.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="default chat")
    bench.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="stream (default on)")
    load = bench.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="requests in flight, one run per level: 1,8,32 (default 1)")
    load.add_argument("--rate", help="Poisson arrivals, requests/s, one run per level: 2,8 or inf")
    bench.add_argument("--max-concurrency", type=int, help="cap on requests in flight with --rate")
    bench.add_argument("--num-prompts", type=int, default=50, help="requests per run (default 50)")
    bench.add_argument("--dataset", type=Path, help="JSONL of {prompt[, max_tokens]} (default: the shipped prompts)")
    bench.add_argument("--input-len", type=int, help="synthetic prompts of this many words instead of a dataset")
    bench.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default 128)")
    bench.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens (vLLM extra)")
    bench.add_argument("--temperature", type=float, default=0.0, help="default 0")
    bench.add_argument("--seed", type=int, default=0, help="prompt order and arrival times (default 0)")
    bench.add_argument("--slo-ttft-ms", type=float, help="goodput: time to first token at most this")
    bench.add_argument("--slo-itl-ms", type=float, help="goodput: mean inter-token time (TPOT) at most this")
    bench.add_argument("--slo-e2e-ms", type=float, help="goodput: end-to-end latency at most this")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    bench.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    kafka = bench.add_argument_group("--target kafka")
    kafka.add_argument("--kafka-bootstrap", help="default: SLUICEGATE_KAFKA_BOOTSTRAP")
    kafka.add_argument("--redis-url", help="where the token streams are read (default: SLUICEGATE_REDIS_URL)")
    kafka.add_argument("--topic-prefix", help="default: SLUICEGATE_TOPIC_PREFIX")
    kafka.add_argument(
        "--priority", choices=["interactive", "standard", "batch"], default="interactive", help="kafka and native"
    )
    batch = bench.add_argument_group("--target batch")
    batch.add_argument("--poll-interval", type=float, default=1.0, help="seconds between batch polls (default 1)")
    bench.set_defaults(handler=_bench)
