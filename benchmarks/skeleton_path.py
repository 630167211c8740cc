"""The request path's skeleton: the contract's hops with as little Python around them as will carry a request,
measured like the pipeline, so the pipeline's overhead can be read against what any implementation of the same
path pays on this machine.

The pipeline benchmark compares its overhead with the *transport floor*: one Kafka record produced and fetched,
one Redis stream entry appended and read. A request on the native path also crosses an HTTP submit and a
WebSocket frame, and each hop is a process that must wake, parse and write. The skeleton has those hops and
nothing else, each in its own process as in the pipeline, on the libraries and settings the services use
(uvicorn with uvloop, httptools and websockets-sansio; aiokafka; redis-py with hiredis):

* ``front`` (ingress's part): ``POST /v1/requests`` -> ``json.loads`` of the body -> one record produced to a
  6-partition topic with ``acks=all``, idempotent, awaited -> ``202`` with the request id; the "queued" status
  record is written after the answer, as ingress writes it off the request's path;
* ``worker``: a group consumer (aiokafka's defaults, a long poll) -> per record, one pipeline of two ``XADD``
  (the first token and ``done``), an ``EXPIRE`` and the final status record, then the final result and the
  usage record produced together (``acks=all``) and awaited; offsets committed every 50 ms;
* ``relay`` (the result service's ``/v1/streams``): one WebSocket per client; each ``subscribe`` starts a
  blocked ``XREAD`` on that request's stream whose entries go out as text frames until ``done``.

It leaves out everything else a Sluicegate request does: authentication, validation against the model, routing,
rate limits, status records, the pickup read, tokenizing, the engine and its process hop, telemetry and
metrics. So its latency and CPU are a lower bound: what the contract's messages cost on this machine when
the code around them is a few lines.

The load is the pipeline benchmark's (open-loop Poisson arrivals, its lean HTTP/1 client and multiplexed
WebSocket reader, stamps taken as bytes are written and arrive); the floor is its ``measure_transport_floor``
on the same Kafka and Redis. Latency of one request = first token at the client - POST sent, comparable with
the pipeline's overhead (which takes the engine's own TTFT off).

    python -m benchmarks.skeleton_path [--rates 10,50] [--duration 15] [--warmup 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from benchmarks.common import (
    fmt,
    free_port,
    markdown_table,
    percentile,
    progress,
    use_uvloop,
)

#: Where the skeleton's processes find Kafka, Redis and their topic (set by :func:`main` for its children).
ENV_KAFKA, ENV_REDIS, ENV_TOPIC = "SKELETON_KAFKA", "SKELETON_REDIS", "SKELETON_TOPIC"
PARTITIONS = 6
COMMIT_INTERVAL_S = 0.05  # the worker's (``commit_interval_s``)
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _stream_key(request_id: str) -> str:
    return f"skeleton:{request_id}"


async def _lifespan(receive: Receive, send: Send, start: Callable[[], Awaitable[None]]) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await start()
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


_producer: Any = None
_front_redis: Any = None
_pending: set[asyncio.Task[Any]] = set()  # status writes in flight (the loop keeps weak references only)


def _status_key(request_id: str) -> str:
    return f"skeleton:request:{request_id}"


def _status(request_id: str, status: str) -> str:
    return json.dumps({"request_id": request_id, "model": "skeleton", "status": status, "created_at": time.time()})


async def front_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Ingress's part: take the POST, publish it durably, answer 202."""
    if scope["type"] == "lifespan":

        async def start() -> None:
            import redis.asyncio as aioredis

            from sluicegate.kafka import create_bare_producer

            global _producer, _front_redis
            _front_redis = aioredis.Redis.from_url(os.environ[ENV_REDIS])
            _producer = create_bare_producer(
                bootstrap=os.environ[ENV_KAFKA], acks="all", enable_idempotence=True, linger_ms=0
            )
            await _producer.start()

        await _lifespan(receive, send, start)
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    request_id = uuid.uuid4().hex
    record = json.dumps({"request_id": request_id, "body": json.loads(body)}).encode()
    await _producer.send_and_wait(os.environ[ENV_TOPIC], record, key=request_id.encode())
    status = asyncio.create_task(_front_redis.set(_status_key(request_id), _status(request_id, "queued"), ex=3600))
    _pending.add(status)
    status.add_done_callback(_pending.discard)
    answer = json.dumps({"request_id": request_id, "stream_token": "-"}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 202, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


_redis: Any = None


async def relay_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """The result service's part: one socket, a blocked ``XREAD`` per subscribed stream, entries out as frames."""
    if scope["type"] == "lifespan":

        async def start() -> None:
            import redis.asyncio as aioredis

            global _redis
            _redis = aioredis.Redis.from_url(os.environ[ENV_REDIS])

        await _lifespan(receive, send, start)
        return
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})

    async def follow(request_id: str) -> None:
        last, key = "0", _stream_key(request_id)
        while True:
            reply = await _redis.xread({key: last}, block=10_000)
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    await send({"type": "websocket.send", "text": fields[b"e"].decode()})
                    if fields.get(b"end"):
                        return

    followers: set[asyncio.Task[None]] = set()
    try:
        while (message := await receive())["type"] == "websocket.receive":
            task = asyncio.create_task(follow(json.loads(message["text"])["request_id"]))
            followers.add(task)
            task.add_done_callback(followers.discard)
    finally:
        for task in followers:
            task.cancel()


async def worker_main() -> None:
    """The worker's part: fetch, append the request's first token and ``done``, commit the offsets."""
    import redis.asyncio as aioredis
    from aiokafka import TopicPartition

    from sluicegate.kafka import create_bare_consumer, create_bare_producer

    consumer = create_bare_consumer(
        os.environ[ENV_TOPIC],
        bootstrap=os.environ[ENV_KAFKA],
        group_id="skeleton-worker",
        enable_auto_commit=False,
        # The topic is this run's own: read from its start, so a request sent before the group's first join (a
        # cold broker takes seconds to elect a coordinator) is served late rather than skipped.
        auto_offset_reset="earliest",
    )
    redis = aioredis.Redis.from_url(os.environ[ENV_REDIS])
    producer = create_bare_producer(bootstrap=os.environ[ENV_KAFKA], acks="all", enable_idempotence=True)
    results_topic = os.environ[ENV_TOPIC] + ".results"
    await asyncio.gather(consumer.start(), producer.start())
    # Each record is served by a task of its own, as the worker serves requests side by side; a partition's
    # offset is committed up to its oldest record still being served.
    serving: dict[TopicPartition, set[int]] = {}
    fetched: dict[TopicPartition, int] = {}
    tasks: set[asyncio.Task[None]] = set()

    async def serve(tp: TopicPartition, offset: int, value: bytes) -> None:
        request_id = json.loads(value)["request_id"]
        token = {"type": "token", "seq": 0, "request_id": request_id, "text": " word", "token_ids": [1]}
        end = {"type": "done", "seq": 1, "request_id": request_id, "finish_reason": "length"}
        key = _stream_key(request_id)
        pipe = redis.pipeline(transaction=False)
        pipe.xadd(key, {"e": json.dumps(token)})
        pipe.xadd(key, {"e": json.dumps(end), "end": "1"})
        pipe.expire(key, 60)
        pipe.set(_status_key(request_id), _status(request_id, "finished"), ex=3600)
        await pipe.execute()
        result = json.dumps({"request_id": request_id, "text": " word", "token_ids": [1]}).encode()
        usage = json.dumps({"request_id": request_id, "prompt_tokens": 8, "completion_tokens": 1}).encode()
        sent = [
            await producer.send(results_topic, result, key=request_id.encode()),
            await producer.send(results_topic, usage, key=request_id.encode()),
        ]
        await asyncio.gather(*sent)
        serving[tp].discard(offset)

    async def commit() -> None:
        committed: dict[TopicPartition, int] = {}
        while True:
            await asyncio.sleep(COMMIT_INTERVAL_S)
            due = {tp: min(serving[tp], default=last + 1) for tp, last in fetched.items()}
            due = {tp: offset for tp, offset in due.items() if committed.get(tp) != offset}
            if due:
                await consumer.commit(due)
                committed.update(due)

    committer = asyncio.create_task(commit())
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            for tp, records in batch.items():
                for record in records:
                    serving.setdefault(tp, set()).add(record.offset)
                    fetched[tp] = record.offset
                    task = asyncio.create_task(serve(tp, record.offset, record.value))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
    finally:
        committer.cancel()
        await asyncio.gather(consumer.stop(), producer.stop())


def _uvicorn(app: str, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "uvicorn", f"benchmarks.skeleton_path:{app}", "--port", str(port)]
    command += ["--loop", "uvloop", "--http", "httptools", "--ws", "websockets-sansio", "--log-level", "warning"]
    return subprocess.Popen([*command, "--no-access-log"], env=env)


async def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def run_rate(front_port: int, relay_port: int, rate: float, duration_s: float, seed: int) -> list[Any]:
    """Open-loop arrivals at ``rate`` for ``duration_s`` (the pipeline's load, on the skeleton's two ports)."""
    from benchmarks.http1 import Http1Pool
    from benchmarks.pipeline_load import Sample, open_loop, open_mux, submit_and_follow

    mux = await open_mux(f"ws://127.0.0.1:{relay_port}/v1/streams")
    async with Http1Pool("127.0.0.1", front_port, {}) as client:

        def launch(i: int, lateness: float) -> tuple[Sample, Coroutine[Any, Any, None]]:
            sample = Sample(lateness=lateness)
            body = {"model": "skeleton", "prompt": f"request {i}: the quick brown fox", "max_tokens": 8}
            return sample, submit_and_follow(client, body, sample, timeout_s=30, mux=mux)

        samples = await open_loop(rate, duration_s, random.Random(f"{seed}-{rate}"), launch)
    mux.transport.close()
    return samples


async def _wait_carried(front_port: int, relay_port: int, timeout_s: float = 120.0) -> None:
    """Return once one request went the whole way (the worker has joined its group and every client is
    connected), so nothing measured waits for start-up."""
    from benchmarks.http1 import Http1Pool
    from benchmarks.pipeline_load import Sample, open_mux, submit_and_follow

    deadline = time.monotonic() + timeout_s
    mux = await open_mux(f"ws://127.0.0.1:{relay_port}/v1/streams")
    try:
        async with Http1Pool("127.0.0.1", front_port, {}) as client:
            while True:
                sample = Sample()
                await submit_and_follow(client, {"prompt": "probe"}, sample, timeout_s=10, mux=mux)
                if sample.error is None and sample.first:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no request went through the skeleton in {timeout_s:g} s: {sample.error}")
    finally:
        mux.transport.close()


async def _measure(args: argparse.Namespace, ports: tuple[int, int], pids: dict[str, int]) -> list[list[str]]:
    from benchmarks.pipeline_load import cpu_seconds, measure_transport_floor
    from sluicegate.settings import Settings

    front_port, relay_port = ports
    await asyncio.gather(_wait_port(front_port), _wait_port(relay_port))
    await _wait_carried(front_port, relay_port)
    if args.warmup > 0:
        progress(f"warm-up: {args.warmup:g} s at 100 req/s ...")
        await run_rate(front_port, relay_port, 100, args.warmup, args.seed + 1)
    levels = []
    for rate in (float(r) for r in args.rates.split(",")):
        progress(f"{rate:g} req/s for {args.duration:g} s ...")
        before = cpu_seconds(pids)
        samples = await run_rate(front_port, relay_port, rate, args.duration, args.seed)
        after = cpu_seconds(pids)
        ok = [s for s in samples if s.error is None and s.first]
        errors = sorted({s.error for s in samples if s.error})[:3]
        if errors:
            progress(f"  {len(samples) - len(ok)} failed: {errors}")
        cpu = {name: 1000 * (after[name] - before[name]) / max(1, len(ok)) for name in after}
        latency = [1000 * (s.first - s.sent) for s in ok]
        levels.append((rate, len(samples), len(ok), latency, cpu))
    progress(f"transport floor: {args.floor_messages} Kafka records and stream entries at 50/s ...")
    settings = Settings(kafka_bootstrap=os.environ[ENV_KAFKA], redis_url=os.environ[ENV_REDIS])
    floor = await measure_transport_floor(settings, messages=args.floor_messages, rate=50)
    (_, _, t50), (_, _, t99) = floor.p(0.5), floor.p(0.99)
    rows = []
    for rate, sent, ok, latency, cpu in levels:
        l50, l99 = percentile(latency, 0.5), percentile(latency, 0.99)
        own = cpu["front"] + cpu["worker"] + cpu["relay"]
        rows.append(
            [
                f"{rate:g}",
                f"{ok}/{sent}",
                f"{fmt(l50)} / {fmt(l99)}",
                f"{fmt(t50)} / {fmt(t99)}",
                f"{fmt(l50 / t50)}x, {fmt(l99 / t99)}x",
                *(fmt(cpu[name], 2) for name in ("front", "worker", "relay")),
                fmt(own, 2),
                *(fmt(cpu.get(name, math.nan), 1) for name in ("kafka", "redis", "clients")),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,50", help="comma-separated arrival rates (requests/s)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of 100 req/s before measuring")
    parser.add_argument("--floor-messages", type=int, default=300)
    parser.add_argument("--kafka-port", type=int, default=29892, help="private stack's Kafka port")
    parser.add_argument("--redis-port", type=int, default=26892, help="private stack's Redis port")
    parser.add_argument("--kafka-bootstrap", help="use this Kafka (with --redis-url) instead of a private stack")
    parser.add_argument("--redis-url", help="use this Redis (with --kafka-bootstrap)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--role", choices=["worker"], help=argparse.SUPPRESS)  # the worker child
    args = parser.parse_args(argv)
    use_uvloop()
    if args.role == "worker":
        asyncio.run(worker_main())
        return 0
    from benchmarks.pipeline_stack import backbone
    from sluicegate.kafka import ensure_topics

    load_before = os.getloadavg()
    args.broker_jit = "full"  # a private broker compiles as a production one does, as in the pipeline benchmark
    args.kafka_bootstrap, args.redis_url, backbone_pids, down = backbone(args)
    topic = f"skeleton.{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), ENV_KAFKA: args.kafka_bootstrap}
    env |= {ENV_REDIS: args.redis_url, ENV_TOPIC: topic}
    os.environ.update({k: env[k] for k in (ENV_KAFKA, ENV_REDIS, ENV_TOPIC)})
    children: dict[str, subprocess.Popen[bytes]] = {}
    try:
        asyncio.run(ensure_topics(args.kafka_bootstrap, {topic: PARTITIONS, f"{topic}.results": PARTITIONS}, 1))
        ports = free_port(), free_port()
        children["front"] = _uvicorn("front_app", ports[0], env)
        children["relay"] = _uvicorn("relay_app", ports[1], env)
        worker_command = [sys.executable, "-m", "benchmarks.skeleton_path", "--role", "worker"]
        children["worker"] = subprocess.Popen(worker_command, env=env)
        pids = {name: child.pid for name, child in children.items()}
        rows = asyncio.run(_measure(args, ports, pids | backbone_pids))
    finally:
        for child in children.values():
            child.terminate()
        for child in children.values():
            child.wait(timeout=30)
        if down is not None:
            down()
    print(
        f"\nrequest-path skeleton on {os.cpu_count()} CPUs; load average before: "
        + " ".join(f"{x:.2f}" for x in load_before)
    )
    print("latency = first token at the client - POST sent; floor = Kafka + Redis stream alone, same backbone\n")
    header = ["req/s", "streamed", "latency p50 / p99 ms", "floor p50 / p99 ms", "latency / floor p50, p99"]
    header += ["front ms CPU/req", "worker", "relay", "own processes", "kafka", "redis", "clients"]
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
