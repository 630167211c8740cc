"""Batch benchmark: how fast a batch runs, and what it costs interactive traffic running beside it.

The stack of the pipeline benchmark (``pipeline_stack.py``: Kafka and Redis, ingress, the result service, one
worker on the tiny random-weight model on CPU) plus a Celery batch worker (``sluicegate batch-worker``). Through
the official ``openai`` SDK, interactive chat requests (``priority: interactive``, streamed) arrive at a steady
rate the whole run; their TTFT is the time from sending the request to the first content chunk. In the same run:

1. ``without batch (before)``: interactive load alone for ``--baseline`` seconds;
2. ``with batch``: a ``--lines``-line batch is uploaded and created; the interactive requests sent while the
   batch is ``in_progress`` are its sample; batch lines/s = lines / (create sent -> terminal status seen);
3. ``without batch (after)``: interactive load alone again, so a drift of the machine shows.

The ratio is the with-batch TTFT p99 over the p99 of both no-batch phases pooled (target: within 1.25x).
The batch's ``eta_seconds``, as the client sees it the first time a tenth of the lines are done, is scored
against the finish the client then sees: |predicted - real| / the time that was really left (target: 25 %).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import fmt, markdown_table, percentile, progress, use_uvloop
from benchmarks.pipeline_stack import API_KEY, MODEL_NAME, Stack, start_stack

DEFAULT_KAFKA_PORT = 29792
DEFAULT_REDIS_PORT = 26792
if TYPE_CHECKING:
    from openai import AsyncOpenAI

TERMINAL = ("completed", "failed", "expired", "cancelled")
TARGET_RATIO = 1.25
#: The batch's ETA is scored when a tenth of its lines are done (within 25 % of the real finish).
ETA_CHECK_AT = 0.10
ETA_TARGET = 0.25


@dataclass
class Sample:
    sent: float
    ttft: float | None = None
    error: str | None = None
    request_id: str | None = None
    #: The engine's own TTFT (first token - arrival at the engine), recorded worker-side.
    engine_ttft: float | None = None


@dataclass
class Phase:
    name: str
    samples: list[Sample] = field(default_factory=list)

    def ttfts_ms(self) -> list[float]:
        return [1000 * s.ttft for s in self.samples if s.ttft is not None]

    def engine_ttfts_ms(self) -> list[float]:
        return [1000 * s.engine_ttft for s in self.samples if s.engine_ttft is not None]

    def errors(self) -> list[str]:
        return [s.error for s in self.samples if s.error]


@dataclass
class BatchRun:
    lines: int
    status: str = ""
    completed: int = 0
    failed: int = 0
    wall_s: float = float("nan")
    #: When the client first saw the batch ``in_progress``, and first saw it past that (monotonic clock).
    in_progress_from: float | None = None
    in_progress_to: float | None = None
    #: The first ``eta_seconds`` seen once a tenth of the lines were done: (seen at, predicted finish), monotonic.
    eta_check: tuple[float, float] | None = None
    finished_at: float | None = None

    @property
    def eta_error(self) -> float:
        """|predicted finish - real finish| / real time left, for the ETA seen at a tenth done (NaN: none seen)."""
        if self.eta_check is None or self.finished_at is None or self.finished_at <= self.eta_check[0]:
            return float("nan")
        seen, predicted = self.eta_check
        return abs(predicted - self.finished_at) / (self.finished_at - seen)

    @property
    def lines_per_s(self) -> float:
        return (self.completed + self.failed) / self.wall_s if self.wall_s > 0 else float("nan")


async def interactive(client: AsyncOpenAI, args: argparse.Namespace, sample: Sample, index: int) -> None:
    """One streamed chat request; ``sample.ttft`` at its first content chunk."""
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Say something about the number {index}"}],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"priority": "interactive", "ignore_eos": True},
        )
        async for chunk in stream:
            if sample.ttft is None and chunk.choices and chunk.choices[0].delta.content:
                sample.ttft = time.monotonic() - sample.sent
                sample.request_id = chunk.id.removeprefix("chatcmpl-")
    except Exception as exc:  # a benchmark reports every failure rather than stopping at the first
        sample.error = f"{type(exc).__name__}: {exc}"[:200]


async def steady_load(
    client: AsyncOpenAI, args: argparse.Namespace, stop: asyncio.Event, samples: list[Sample]
) -> None:
    """Send a request every 1/rate seconds (open loop) until ``stop``; wait for those in flight."""
    tasks: list[asyncio.Task[None]] = []
    period = 1.0 / args.rate
    next_at = time.monotonic()
    while not stop.is_set():
        sample = Sample(sent=time.monotonic())
        samples.append(sample)
        tasks.append(asyncio.create_task(interactive(client, args, sample, len(samples))))
        next_at += period
        try:
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, next_at - time.monotonic()))
        except TimeoutError:
            pass
    await asyncio.gather(*tasks)


async def alone(client: AsyncOpenAI, args: argparse.Namespace, name: str, seconds: float) -> Phase:
    phase = Phase(name)
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(client, args, stop, phase.samples))
    await asyncio.sleep(seconds)
    stop.set()
    await load
    return phase


def batch_file(path: Path, lines: int, max_tokens: int) -> Path:
    with path.open("w") as handle:
        for i in range(lines):
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": f"Summarise document {i}"}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            handle.write(json.dumps(line) + "\n")
    return path


async def with_batch(client: AsyncOpenAI, args: argparse.Namespace, workdir: Path) -> tuple[Phase, BatchRun]:
    """Run the batch with the interactive load beside it; keep the interactive samples sent while in progress."""
    path = batch_file(workdir / "batch.jsonl", args.lines, args.batch_max_tokens)
    with path.open("rb") as handle:
        uploaded = await client.files.create(file=handle, purpose="batch")
    samples: list[Sample] = []
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(client, args, stop, samples))
    run = BatchRun(args.lines)
    created = time.monotonic()
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    last_report = 0.0
    try:
        while batch.status not in TERMINAL:
            if time.monotonic() - created > args.batch_timeout:
                raise SystemExit(f"the batch did not finish within {args.batch_timeout:g} s: {batch.status}")
            await asyncio.sleep(0.25)
            batch = await client.batches.retrieve(batch.id)
            now = time.monotonic()
            if batch.status == "in_progress" and run.in_progress_from is None:
                run.in_progress_from = now
            if batch.status != "in_progress" and run.in_progress_from is not None and run.in_progress_to is None:
                run.in_progress_to = now
            counts = batch.request_counts
            eta = (batch.model_extra or {}).get("eta_seconds")
            done = counts.completed + counts.failed if counts is not None else 0
            if run.eta_check is None and eta is not None and counts and done >= ETA_CHECK_AT * counts.total:
                run.eta_check = (now, now + float(eta))
            if batch.status in TERMINAL and run.finished_at is None:
                run.finished_at = now
            if counts is not None and now - last_report > 5:
                last_report = now
                progress(f"  batch {batch.status}: {counts.completed + counts.failed}/{counts.total}")
    finally:
        stop.set()
        await load
    run.wall_s = time.monotonic() - created
    run.status = batch.status
    if batch.request_counts is not None:
        run.completed, run.failed = batch.request_counts.completed, batch.request_counts.failed
    start = run.in_progress_from if run.in_progress_from is not None else created
    end = run.in_progress_to if run.in_progress_to is not None else time.monotonic()
    phase = Phase("with batch", [s for s in samples if start <= s.sent < end])
    return phase, run


async def measure(stack: Stack, args: argparse.Namespace) -> tuple[list[Phase], BatchRun]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{stack.ingress_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    try:
        if args.warmup > 0:
            progress(f"warm-up: {args.warmup:g} s at {args.rate:g} req/s ...")
            await alone(client, args, "warm-up", args.warmup)
        progress(f"without batch: {args.baseline:g} s at {args.rate:g} req/s ...")
        before = await alone(client, args, "without batch (before)", args.baseline)
        progress(f"with a {args.lines}-line batch ...")
        during, run = await with_batch(client, args, stack.workdir)
        progress(f"without batch again: {args.baseline:g} s ...")
        after = await alone(client, args, "without batch (after)", args.baseline)
    finally:
        await client.close()
    return [before, during, after], run


def report(phases: list[Phase], run: BatchRun, args: argparse.Namespace) -> str:
    rows = []
    for phase in phases:
        ttfts, engine = phase.ttfts_ms(), phase.engine_ttfts_ms()
        rows.append(
            [
                phase.name,
                str(len(phase.samples)),
                str(len(phase.errors())),
                fmt(percentile(ttfts, 0.5)),
                fmt(percentile(ttfts, 0.99)),
                fmt(percentile(engine, 0.5)),
                fmt(percentile(engine, 0.99)),
            ]
        )
    pooled = phases[0].ttfts_ms() + phases[2].ttfts_ms()
    pooled_engine = phases[0].engine_ttfts_ms() + phases[2].engine_ttfts_ms()
    without_p99, with_p99 = percentile(pooled, 0.99), percentile(phases[1].ttfts_ms(), 0.99)
    ratio = with_p99 / without_p99 if without_p99 > 0 else float("nan")
    rows.append(
        [
            "without batch (pooled)",
            str(len(pooled)),
            "",
            fmt(percentile(pooled, 0.5)),
            fmt(without_p99),
            fmt(percentile(pooled_engine, 0.5)),
            fmt(percentile(pooled_engine, 0.99)),
        ]
    )
    lines = [
        f"batch: {run.lines} lines, max_tokens {args.batch_max_tokens}; status {run.status}; "
        f"{run.completed} completed, {run.failed} failed in {fmt(run.wall_s)} s = {fmt(run.lines_per_s)} lines/s",
        f"interactive: {args.rate:g} req/s steady, max_tokens {args.max_tokens}, streamed, priority interactive",
        "",
        markdown_table(
            ["interactive phase", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "engine p50 ms", "engine p99 ms"],
            rows,
        ),
        "(TTFT: request sent -> first content chunk at the client; engine: the engine's own TTFT, arrival at the "
        "engine -> first token, recorded worker-side)",
        "",
        f"TTFT p99 with batch / without: {fmt(ratio, 2)}x (target <= {TARGET_RATIO}x)",
        f"ETA error (eta_seconds seen once {ETA_CHECK_AT:.0%} of the lines were done, against the real finish): "
        f"{fmt(100 * run.eta_error, 1)} % of the time that was really left (target <= {ETA_TARGET:.0%})",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kafka-bootstrap", help="use this Kafka (with --redis-url) instead of a private dev stack")
    parser.add_argument("--redis-url", help="use this Redis (with --kafka-bootstrap)")
    parser.add_argument("--kafka-port", type=int, default=DEFAULT_KAFKA_PORT, help="private stack's Kafka port")
    parser.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT, help="private stack's Redis port")
    parser.add_argument("--broker-jit", choices=("full", "c1"), default="c1", help="JIT of the private broker")
    parser.add_argument("--partitions", type=int, default=2, help="partitions per topic")
    parser.add_argument("--engine", choices=("process", "thread"), default="process")
    parser.add_argument("--log-level", default="WARNING", help="log level of the services")
    parser.add_argument("--lines", type=int, default=2000, help="lines in the batch")
    parser.add_argument("--batch-max-tokens", type=int, default=16, help="max_tokens of every batch line")
    parser.add_argument("--rate", type=float, default=5.0, help="interactive requests per second")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of an interactive request")
    parser.add_argument("--baseline", type=float, default=30.0, help="seconds of each no-batch phase")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of interactive warm-up first")
    parser.add_argument("--batch-timeout", type=float, default=1800.0, help="give up on the batch after this")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (service logs, model, files)")
    args = parser.parse_args(argv)
    if args.lines < 1 or args.rate <= 0 or args.baseline <= 0:
        parser.error("--lines, --rate and --baseline must be positive")

    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    # Ingress and the batch worker share the files folder; the batch worker ticks often for a short run.
    extra = {"SLUICEGATE_FILES_URL": str(workdir / "files"), "SLUICEGATE_BATCH_TICK_S": "0.5"}
    stack = start_stack(args, workdir, extra_env=extra)
    try:
        stack.spawn("batch-worker", "batch-worker")
        phases, run = asyncio.run(measure(stack, args))
        stack.check_alive()
        stamps = stack.stop_worker()["stamps"]
        for sample in (s for phase in phases for s in phase.samples):
            entry = stamps.get(sample.request_id or "", {})
            if "first_token" in entry and "arrival" in entry:
                sample.engine_ttft = entry["first_token"] - entry["arrival"]
    finally:
        stack.close()
        if args.keep:
            progress(f"logs, model and files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nbatch benchmark on {os.cpu_count()} CPUs (Kafka, Redis, services, worker, Celery and clients share "
        f"them); model: tiny random Llama (2 layers, hidden 64) on CPU, 1 torch thread\n"
    )
    print(report(phases, run, args))
    failed = run.status != "completed" or any(phase.errors() for phase in phases)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
