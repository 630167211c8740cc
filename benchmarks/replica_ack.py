"""What the worker's ``replica_ack`` costs per flush: ``StreamPublisher.flush`` latency without it, with it
(``ROLE`` at the end of each flush's pipeline, events kept until a replica acknowledges them) and, for
comparison, the design it replaced on paper: ``WAIT 1 <ms>`` after each flush (blocks until the replica has the
appends).

Starts its own ``redis-server`` primary and replica on free ports (:class:`benchmarks.redis_failover.RedisPair`),
then interleaves the three modes in rounds so that the shared box's load hits each alike. Each flush carries
``--events`` token events of one request (a busy engine step's worth). Prints one JSON line:

    PYTHONPATH=$PWD python3 -m benchmarks.replica_ack --flushes 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid

from redis.asyncio import Redis

from benchmarks.common import percentile
from benchmarks.redis_failover import redis_pair
from gpu_workers.worker.streams import StreamPublisher
from schemas import Names, TokenEvent
from sluicegate.redis_client import create_redis


def _events(request_id: str, start: int, n: int) -> list[TokenEvent]:
    seqs = range(start, start + n)
    return [TokenEvent(request_id=request_id, seq=seq, text=" tok", token_ids=[seq % 30_000]) for seq in seqs]


async def _measure(client: Redis, names: Names, mode: str, flushes: int, events: int, wait_ms: int) -> list[float]:
    """Seconds per flush of ``flushes`` flushes of ``events`` events each in ``mode`` (off / role / wait)."""
    publisher = StreamPublisher(client, names, ttl_s=60, replica_ack=mode == "role")
    request_id = uuid.uuid4().hex
    took = []
    for i in range(flushes):
        for event in _events(request_id, i * events, events):
            publisher.add(event)
        started = time.perf_counter()
        await publisher.flush()
        if mode == "wait":
            await client.execute_command("WAIT", 1, wait_ms)
        took.append(time.perf_counter() - started)
    await client.delete(names.stream_key(request_id))
    return took


async def _main(args: argparse.Namespace) -> dict[str, object]:
    with redis_pair() as pair:
        await pair.synced()
        client = create_redis(url=pair.node_url("primary"), socket_timeout=5, retries=0)
        names = Names(f"bench{os.getpid()}")
        samples: dict[str, list[float]] = {"off": [], "role": [], "wait": []}
        try:
            await _measure(client, names, "off", 200, args.events, args.wait_ms)  # warm-up
            for _ in range(args.rounds):
                for mode in samples:
                    samples[mode] += await _measure(client, names, mode, args.flushes, args.events, args.wait_ms)
        finally:
            await client.aclose()
    result: dict[str, object] = {"flushes_per_mode": args.flushes * args.rounds, "events_per_flush": args.events}
    for mode, took in samples.items():
        result[mode] = {q: round(percentile(took, p) * 1e3, 3) for q, p in (("p50_ms", 0.5), ("p99_ms", 0.99))}
    result["role_over_off_p50"] = round(result["role"]["p50_ms"] / result["off"]["p50_ms"], 2)  # type: ignore[index]
    result["wait_over_off_p50"] = round(result["wait"]["p50_ms"] / result["off"]["p50_ms"], 2)  # type: ignore[index]
    result["load_average"] = os.getloadavg()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flushes", type=int, default=2000, help="flushes per mode per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the three modes")
    parser.add_argument("--events", type=int, default=4, help="token events per flush")
    parser.add_argument("--wait-ms", type=int, default=100, help="timeout of WAIT in the wait mode")
    print(json.dumps(asyncio.run(_main(parser.parse_args()))))


if __name__ == "__main__":
    main()
