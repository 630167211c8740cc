"""Nemesis: the whole pipeline under mixed clients while workers are killed, paused past their session timeout and
cut off from Kafka or from Redis, one at a time; then every stream and result is checked (Jepsen style).

The stack (``benchmarks.nemesis_stack``): 3 KRaft brokers and a Sentinel-watched Redis on a bridge, the router,
ingress, result service and a Celery batch worker, and ``--workers`` CPU workers on a random-weight model, each in
a network namespace of its own (``benchmarks.nemesis_faults``). ``redis-cli monitor`` on the primary logs every
command, so entries without writer and epoch fields are attributed by the address that sent them
(``benchmarks.nemesis_history``). Clients: ``benchmarks.nemesis_clients``. Faults: from every ``--spacing``
seconds, once every worker owns partitions again, the next kind (``pause``, ``partition_kafka``,
``partition_redis``, ``kill``) against the next worker. At the end the checker (``benchmarks.nemesis_check``) reads
every request's history; the history is written as JSON (``--out``) and a summary printed, with the longest pause
of the streams each fault should have spared (``spared_stream_pause_s``). Exit status 1 when anything was lost,
duplicated or mixed. Needs root (network namespaces):

    PYTHONPATH=$PWD python3 -m benchmarks.nemesis --minutes 10 --spacing 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from benchmarks.common import percentile, progress
from benchmarks.nemesis_check import History, RequestHistory, Verdict, check
from benchmarks.nemesis_clients import Clients
from benchmarks.nemesis_faults import Fault, FaultKind, WorkerNetwork, schedule
from benchmarks.nemesis_history import CommandLog, entries_of
from benchmarks.nemesis_stack import API_KEY, MODEL, Stack, inject
from schemas import STREAM_FIELD, FinalResult, Names, parse_stream_event
from sluicegate.dead_letter_admin import read_topic


async def settled(stack: Stack, names: Names, timeout_s: float = 180.0) -> float:
    """Until every worker runs and owns partitions again (a worker that exited is started again): a fault against a
    worker still starting, or while the group still rebalances, tests nothing. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for name in stack.workers:
            if stack.services[name].poll() is not None:
                progress(f"nemesis: {name} had exited ({stack.services[name].returncode}); starting it again")
                stack.start_worker(name)
        if await asyncio.to_thread(stack.owners, names) == set(stack.workers):
            break
        await asyncio.sleep(1.0)
    return time.monotonic() - started


async def drive(stack: Stack, clients: Clients, faults: list[Fault]) -> list[tuple[Fault, float, float]]:
    """Clients for ``--minutes`` while the faults run on schedule (each once the group has settled after the last);
    then the drain."""
    stop = asyncio.Event()
    load = asyncio.create_task(clients.run(stop, stack.args.interval_s, stack.args.batch_every_s))
    begun, done = time.monotonic(), []
    for fault in faults:
        await asyncio.sleep(max(0.0, begun + fault.at_s - time.monotonic()))
        if time.monotonic() - begun + fault.hold_s > stack.args.minutes * 60:
            break  # waiting for the group pushed it past the run's end
        await settled(stack, clients.names)
        progress(f"nemesis t={time.monotonic() - begun:.0f}s {fault.kind} {fault.worker} for {fault.hold_s:.0f}s")
        start, end = await inject(stack, fault)
        done.append((fault, start, end))
    await asyncio.sleep(max(0.0, begun + stack.args.minutes * 60 - time.monotonic()))
    stop.set()
    progress("nemesis: load stopped; waiting for every request's end")
    await load
    await clients.finish_batches(stack.args.drain_s)
    return done


async def drained(redis: Redis, clients: Clients, timeout_s: float) -> None:
    """Until every accepted request's stream ends (or ``timeout_s``): streams still finishing after the load."""
    deadline = time.monotonic() + timeout_s
    pending = set(clients.sent)
    while pending and time.monotonic() < deadline:
        for rid in list(pending):
            last = await redis.xrevrange(clients.names.stream_key(rid), count=1)
            if last and parse_stream_event(last[0][1][STREAM_FIELD.encode()]).type in ("done", "error"):
                pending.discard(rid)
        if pending:
            await asyncio.sleep(1.0)


async def histories(redis: Redis, clients: Clients, log: CommandLog) -> list[RequestHistory]:
    """Every accepted request's stream (attributed), what its client saw, and its results on Kafka."""
    names = clients.names
    results = Counter(
        FinalResult.model_validate_json(r.value).request_id
        for r in await read_topic(clients.kafka_bootstrap, names.results_topic)
    )
    out = []
    for rid, sent in clients.sent.items():
        key = names.stream_key(rid)
        out.append(
            RequestHistory(
                request_id=rid,
                client=sent.client,
                sampled=sent.sampled,
                entries=entries_of(key, await redis.xrange(key), log),
                received_seqs=sent.received_seqs,
                client_finished=sent.client_finished,
                results=results.get(rid, 0),
            )
        )
    return out


async def collect(stack: Stack, clients: Clients) -> tuple[list[RequestHistory], CommandLog]:
    """After the drain: the command log (every append so far), then every request's history."""
    assert stack.sentinels is not None
    redis = Redis.from_url(stack.sentinels.node_url("primary"))
    try:
        await drained(redis, clients, stack.args.drain_s)
        log = CommandLog({address: name for name, address in stack.net.addresses.items()}, names_prefix(clients))
        with (stack.workdir / "monitor.log").open(errors="replace") as lines:
            log.feed_file(lines)
        return await histories(redis, clients, log), log
    finally:
        await redis.aclose()


def names_prefix(clients: Clients) -> str:
    """What every stream key of the run starts with."""
    return clients.names.stream_key("x")[:-1]


def summary(verdict: Verdict, faults: list[tuple[Fault, float, float]], pauses: list[float], **extra: Any) -> dict:
    kinds: Counter[FaultKind] = Counter(f.kind for f, _, _ in faults)
    return {
        "requests": verdict.requests,
        "outcomes": verdict.outcomes,
        "by_client": verdict.by_client,
        "lost": verdict.lost,
        "duplicated": verdict.duplicated,
        "mixed": verdict.mixed,
        "mixed_sampled": verdict.mixed_sampled,
        "zombie_streams": verdict.zombie_streams,
        "gaps": verdict.gaps,
        "unattributed_entries": verdict.unattributed_entries,
        "result_duplicates": verdict.result_duplicates,
        "faults": dict(kinds),
        "spared_stream_pause_s": {
            "n": len(pauses),
            "p50": round(percentile(pauses, 0.5), 3),
            "p99": round(percentile(pauses, 0.99), 3),
            "max": round(max(pauses, default=0.0), 3),
        },
        **extra,
        "findings": [f"{f.request_id}: {f.kind}: {f.detail}" for f in verdict.findings[:40]],
    }


SESSION_EXPIRED = "Heartbeat session expired"  # aiokafka's line when the group dropped this member


def false_session_timeouts(workdir: Path, windows: list[tuple[float, float, str]]) -> list[str]:
    """Workers whose group session expired outside every fault against them: the box starved them (the spacing
    or the load is too much for it), not the nemesis. One ``worker@time`` each."""
    found = []
    for log in sorted(workdir.glob("w*.log")):
        worker = log.stem
        for line in log.read_text(errors="replace").splitlines():
            if SESSION_EXPIRED not in line or not line.startswith("ts="):
                continue
            at = datetime.fromisoformat(line[3:].split(" ", 1)[0]).timestamp()
            if not any(start <= at <= end and worker == faulted for start, end, faulted in windows):
                found.append(f"{worker}@{line[14:22]}")
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="sluicegate-nemesis-"))
    args.model_dir = make_tiny_model(workdir / MODEL, arch="llama", num_layers=args.layers, hidden_size=args.hidden)
    stack = Stack(args, workdir, WorkerNetwork(subnet=args.subnet))
    try:
        stack.up()
        holds = {"kill": args.kill_down_s, "pause": args.pause_s, "partition_kafka": args.partition_s}
        holds["partition_redis"] = args.partition_s
        faults = schedule(args.minutes * 60, stack.workers, args.spacing, holds, first_s=args.spacing / 2)
        clients = Clients(
            stack.ingress,
            stack.result_ws,
            API_KEY,
            MODEL,
            Names(stack.env["SLUICEGATE_TOPIC_PREFIX"]),
            stack.env["SLUICEGATE_KAFKA_BOOTSTRAP"],
            args.max_tokens,
            args.seed,
        )
        injected = asyncio.run(drive(stack, clients, faults))
        requests, log = asyncio.run(collect(stack, clients))
    finally:
        stack.down()
    fenced = any(e.writer is not None and e.newest_epoch is None for r in requests for e in r.entries)
    history = History(attribution="fields" if fenced else "monitor", requests=requests)
    (Path(args.out) if args.out else workdir / "history.json").write_text(history.model_dump_json())
    verdict = check(history)
    writers = {
        clients.names.stream_key(r.request_id): {e.writer for e in r.entries if e.writer} for r in history.requests
    }
    windows = [(start, end + args.settle_s, fault.worker) for fault, start, end in injected]
    result = summary(
        verdict,
        injected,
        log.longest_pauses(windows, writers),
        attribution=history.attribution,
        minutes=args.minutes,
        spacing_s=args.spacing,
        refused=clients.refused,
        refused_appends=log.refused_appends,
        false_session_timeouts=false_session_timeouts(workdir, windows),
        workdir=str(workdir),
    )
    if not args.keep and verdict.ok:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--spacing", type=float, default=30.0, help="seconds between two faults' starts")
    p.add_argument("--pause-s", type=float, default=15.0, help="SIGSTOP hold (over the session timeout)")
    p.add_argument("--partition-s", type=float, default=15.0)
    p.add_argument("--kill-down-s", type=float, default=2.0, help="how long a killed worker stays down")
    p.add_argument("--settle-s", type=float, default=10.0, help="after a fault, how long its rebalance may pause")
    p.add_argument("--session-timeout-ms", type=int, default=6000)
    p.add_argument("--interval-s", type=float, default=1.5, help="mean seconds between requests of each client kind")
    p.add_argument("--batch-every-s", type=float, default=60.0, help="a batch of 4 lines this often (0: none)")
    p.add_argument("--max-tokens", type=int, default=192, help="each request asks for 32 up to this many tokens")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--drain-s", type=float, default=180.0)
    p.add_argument("--first-port", type=int, default=41000)
    p.add_argument("--subnet", default="10.241.0", help="the bridge's /24 (first three octets)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="", help="where to write the history JSON (default: the work folder)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, monitor log)")
    return p


def main() -> int:
    result = run(parser().parse_args())
    print(json.dumps(result, indent=1))
    return 0 if not (result["lost"] or result["duplicated"] or result["mixed"]) else 1


if __name__ == "__main__":
    sys.exit(main())
