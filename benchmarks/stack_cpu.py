"""What the stack takes from the cores while it serves one stream: CPU per second of each process.

Finds a running ``sluicegate up``'s processes as ``idle_cpu.py`` does (each ``cli.main`` role, the engine's child,
the Kafka JVM, ``redis-server``), reads their CPU time (``/proc/<pid>/stat``, all threads) at both ends of a window
and, during it, streams chat completions through the ``openai`` SDK one after another (concurrency 1, greedy,
``--output-len`` tokens each). Prints, per process, ms of CPU per second and per generated token, and the client's
decode tok/s after the first token and TTFT p50, so the share that is not the engine's can be cut and measured again.

    bash infra/local/run.sh up &   # wait for "Sluicegate is up"
    python -m benchmarks.stack_cpu [--seconds 30] [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import markdown_table, process_cpu_seconds
from benchmarks.idle_cpu import stack_processes

PROMPT = "Tell me about the longest rivers in the world and why they matter."


@dataclass
class Streams:
    """What the client saw over the window: tokens, and per stream its TTFT and decode rate."""

    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)


async def stream_one(client: Any, model: str, output_len: int, seen: Streams, prompt: str = PROMPT) -> None:
    """One streamed completion; decode tok/s counts the chunks after the first over the time after it."""
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        now = time.perf_counter()
        chunks += 1
        if chunks == 1:
            first = now
        last = now
    if chunks == 0:
        raise RuntimeError("a stream ended without a token")
    seen.tokens += chunks
    seen.ttft_s.append(first - start)
    if chunks > 1 and last > first:
        seen.decode_tok_s.append((chunks - 1) / (last - first))


async def drive(base_url: str, api_key: str, output_len: int, seconds: float, pids: dict[int, str]) -> tuple:
    """Streams one at a time for ``seconds`` (after one warm-up stream), with every process's CPU read around it."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = (await client.models.list()).data[0].id
    await stream_one(client, model, output_len, Streams())  # warm: first-request costs stay out
    before = {}
    for pid in pids:
        try:
            before[pid] = process_cpu_seconds(pid)
        except OSError:
            continue
    seen = Streams()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        await stream_one(client, model, output_len, seen)
    elapsed = time.perf_counter() - start
    cpu: dict[int, float] = {}
    for pid, was in before.items():
        try:
            cpu[pid] = process_cpu_seconds(pid) - was
        except OSError:
            continue
    await client.close()
    return seen, elapsed, cpu


def report(pids: dict[int, str], seen: Streams, elapsed: float, cpu: dict[int, float]) -> str:
    by_role: dict[str, float] = {}
    for pid, seconds in cpu.items():
        by_role[pids[pid]] = by_role.get(pids[pid], 0.0) + seconds
    rows = sorted(by_role.items(), key=lambda row: -row[1])
    total = sum(by_role.values())
    not_engine = total - by_role.get("engine", 0.0)
    lines = [
        f"{len(seen.ttft_s)} streams, {seen.tokens} tokens in {elapsed:.1f} s; decode tok/s after the first token "
        f"p50 {statistics.median(seen.decode_tok_s):.1f}; TTFT p50 {1e3 * statistics.median(seen.ttft_s):.0f} ms",
        f"CPU of the stack {1e3 * total / elapsed:.0f} ms/s, of which not the engine's "
        f"{1e3 * not_engine / elapsed:.0f} ms/s ({100 * not_engine / total:.0f} %)",
        "",
        markdown_table(
            ["process", "ms of CPU per second", "ms of CPU per token"],
            [(r, f"{1e3 * s / elapsed:.1f}", f"{1e3 * s / max(seen.tokens, 1):.2f}") for r, s in rows],
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="measurement window (default 30)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="sk-local")
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.output_len < 2:
        parser.error("--seconds must be positive and --output-len at least 2")
    pids = stack_processes()
    if not pids:
        print("no Sluicegate stack is running here: start one with `bash infra/local/run.sh up`", file=sys.stderr)
        return 1
    seen, elapsed, cpu = asyncio.run(drive(args.base_url, args.api_key, args.output_len, args.seconds, pids))
    print(report(pids, seen, elapsed, cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
