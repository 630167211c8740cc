"""What fencing costs per flush: the worker's stream flush as it was (a pipeline of plain ``XADD``\\ s) against the
fenced flush (``StreamPublisher``: one call of the fenced-write script for the whole flush, its SHA queued on the
pipeline) and, for comparison, the same call through redis-py's ``Script`` object on the pipeline (``SCRIPT EXISTS``
before every pipeline).

Each flush carries one token event for each of ``--requests`` requests (an engine step of a busy worker). The
modes are interleaved in rounds so that the shared box's load hits each alike. Runs against the Redis at
``--redis-url`` (default ``SLUICEGATE_TEST_REDIS_URL``, else the settings' URL). Prints one JSON line:

    PYTHONPATH=$PWD python3 -m benchmarks.fenced_appends --flushes 2000 --rounds 5 --requests 8
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
from gpu_workers.worker.fencing import FENCED_WRITE
from gpu_workers.worker.streams import StreamPublisher
from schemas import STREAM_FIELD, Names, TokenEvent, stream_entry_id
from sluicegate.redis_client import create_redis
from sluicegate.settings import RedisSettings

MODES = ("plain", "fenced", "script_object")


def _event(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, seq=seq, text=" tok", token_ids=[seq % 30_000])


async def _measure(client: Redis, names: Names, mode: str, flushes: int, requests: int) -> list[float]:
    """Seconds per flush of ``flushes`` flushes in ``mode``."""
    ids = [uuid.uuid4().hex for _ in range(requests)]
    publisher = StreamPublisher(client, names, ttl_s=60, worker_id="bench")
    script = client.register_script(FENCED_WRITE)
    epochs = {rid: await client.incr(names.epoch_key(rid)) for rid in ids}  # each request picked up once
    took = []
    for seq in range(flushes):
        events = [_event(rid, seq) for rid in ids]
        started = time.perf_counter()
        if mode == "fenced":
            for event in events:
                publisher.add(event, epoch=epochs[event.request_id])
            await publisher.flush()
        else:
            pipe = client.pipeline(transaction=False)
            keys: list[str] = []
            args: list[object] = ["bench", 60]
            for event in events:
                key, entry_id = names.stream_key(event.request_id), stream_entry_id(event.seq)
                if mode == "plain":
                    pipe.xadd(key, {STREAM_FIELD: event.model_dump_json()}, id=entry_id)
                else:  # the publisher's one call per flush, through redis-py's Script object
                    keys += [names.epoch_key(event.request_id), key]
                    args += [len(keys) - 1, epochs[event.request_id], 1, "a", len(keys), entry_id]
                    args.append(event.model_dump_json())
            if mode == "script_object":
                await script(keys=keys, args=args, client=pipe)
            await pipe.execute()
        took.append(time.perf_counter() - started)
    await client.delete(*[names.stream_key(rid) for rid in ids], *[names.epoch_key(rid) for rid in ids])
    return took


async def _main(args: argparse.Namespace) -> dict[str, object]:
    url = args.redis_url or os.environ.get("SLUICEGATE_TEST_REDIS_URL") or RedisSettings().redis_url
    client = create_redis(url=url, socket_timeout=5, retries=0)
    names = Names(f"benchfence{os.getpid()}")
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm-up: connections, the script loaded
            await _measure(client, names, mode, 100, args.requests)
        for _ in range(args.rounds):
            for mode in MODES:
                samples[mode] += await _measure(client, names, mode, args.flushes, args.requests)
    finally:
        await client.aclose()
    out: dict[str, object] = {"flushes": args.flushes * args.rounds, "requests_per_flush": args.requests}
    for mode, took in samples.items():
        out[mode] = {
            "p50_ms": round(1000 * percentile(took, 0.5), 3),
            "p99_ms": round(1000 * percentile(took, 0.99), 3),
            "appends_per_s": round(args.requests * len(took) / sum(took)),
        }
    plain = percentile(samples["plain"], 0.5)
    out["fenced_over_plain_p50"] = round(percentile(samples["fenced"], 0.5) / plain, 2)
    out["script_object_over_plain_p50"] = round(percentile(samples["script_object"], 0.5) / plain, 2)
    out["load_average"] = round(os.getloadavg()[0], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flushes", type=int, default=2000, help="flushes per mode per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the modes")
    parser.add_argument("--requests", type=int, default=8, help="requests with one token event in each flush")
    parser.add_argument("--redis-url", default="", help="Redis to run against (default: the test Redis)")
    print(json.dumps(asyncio.run(_main(parser.parse_args()))))


if __name__ == "__main__":
    main()
