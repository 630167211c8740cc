"""What one message of the request path costs on this machine with no Sluicegate code around it: the floor under
the pipeline's CPU per request.

Each primitive runs ``--count`` times, one at a time, paced at ``--rate`` per second, so every operation pays its
own wake-ups as a request's messages do at 50 requests/s. The figure is CPU (user + system) per operation of the
process that makes the call, where the call's Python lives; for HTTP and WebSocket, of the server (a bare ASGI
app under uvicorn, with the services' settings: uvloop, httptools, websockets-sansio), since that is the side our
services play. The clients are the libraries the services use (redis-py with hiredis, aiokafka) on uvloop.

- ``wake-up``: an idle event loop woken by a timer and going back to sleep, nothing else (taken off every
  client-side figure below, as the pacing's own; what any message that finds a process idle costs it on top)
- ``redis``: one ``SET`` of a 300-byte value, awaited (a status record alone)
- ``redis-pipeline``: four commands in one pipeline (a pickup read, a flush of appends)
- ``redis-wake``: a blocked ``XREAD`` woken by an ``XADD`` from another connection, the reader's CPU per wake-up
  (the writer's ``XADD`` measured alone and taken off)
- ``kafka-produce``: a 200-byte record, ``acks=all`` and idempotent, awaited (ingress's publish)
- ``kafka-fetch``: a consumer long-polling the record's partition, its CPU per record fetched one at a time
  (the produce taken off)
- ``http``: a 200-byte JSON ``POST`` answered ``202`` (a submit), the server's CPU
- ``websocket``: connect, six text frames from the server, close (one request's stream), the server's CPU

``--with-counts`` multiplies them by the request path's messages per request (``redis_trips`` and the code) and
prints what the messages alone cost each service per request.

    python -m benchmarks.message_costs [--rate 200] [--count 2000] [--kafka-bootstrap ... --redis-url ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import free_port, markdown_table, process_cpu_seconds, start_private_stack, use_uvloop

VALUE = b"x" * 300
RECORD = b"r" * 200
BODY = json.dumps({"model": "m", "prompt": "p" * 160}).encode()
FRAME = json.dumps({"type": "token", "seq": 0, "text": " word", "token_ids": [1]})

# Messages per request on the path at 50 req/s, 8 tokens, stream interval 5 ms (docs/benchmarks.md):
# Redis round trips from redis_trips; one produce and one fetched record per Kafka leg; one POST; one stream.
PATH_COUNTS: dict[str, dict[str, float]] = {
    "ingress": {"http": 1, "kafka-produce": 1, "redis": 1},
    "worker": {"kafka-fetch": 1, "kafka-produce": 1, "redis-pipeline": 3.6},
    "result service": {"websocket": 1, "redis-pipeline": 1, "redis-wake": 4.4},
}


async def bare_app(scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Any) -> None:
    """The smallest ASGI app playing ingress's submit (POST -> 202 JSON) and the relay (six frames, close)."""
    if scope["type"] == "http":
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        body = b'{"request_id":"r","stream_url":"ws://h/v1/streams/r","stream_token":"t"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 202, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        for _ in range(6):
            await send({"type": "websocket.send", "text": FRAME})
        await send({"type": "websocket.close", "code": 1000})
    elif scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


async def _nothing() -> None:
    return None


async def paced(op: Callable[[], Awaitable[Any]], count: int, rate: float) -> float:
    """Run ``op`` ``count`` times at ``rate`` per second; this process's CPU seconds per operation, the pacing's
    own timer wake-up included (:func:`run` takes it off the operations measured alone)."""
    for _ in range(20):  # connections made, caches warm
        await op()
    started = time.process_time()
    loop = asyncio.get_running_loop()
    due = loop.time()
    for _ in range(count):
        await op()
        due += 1 / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
    return (time.process_time() - started) / count


#: Client-side figures of one paced operation each, which carry the pacing's wake-up; the others are differences
#: of two paced runs (the wake-up cancels) or the server's CPU.
_PACED_ALONE = ("redis", "redis-pipeline", "kafka-produce")


async def measure_redis(url: str, count: int, rate: float) -> dict[str, float]:
    import redis.asyncio as aioredis

    writer, reader = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
    key = f"costs:{uuid.uuid4().hex[:8]}"
    out: dict[str, float] = {}
    try:
        out["redis"] = await paced(lambda: writer.set(key, VALUE, ex=60), count, rate)

        async def pipeline() -> None:
            pipe = writer.pipeline(transaction=False)
            pipe.xrange(key + ":s", "-", "+")
            pipe.get(key)
            pipe.exists(key + ":c")
            pipe.set(key, VALUE, ex=60)
            await pipe.execute()

        out["redis-pipeline"] = await paced(pipeline, count, rate)
        stream = key + ":wake"
        xadd_alone = await paced(lambda: writer.xadd(stream, {"e": VALUE}, maxlen=100), count, rate)
        woken = asyncio.Event()

        async def follow() -> None:
            last = "$"
            while True:
                reply = await reader.xread({stream: last}, block=5000)
                for _, entries in reply:
                    last = entries[-1][0]
                woken.set()

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.2)

        async def wake() -> None:
            woken.clear()
            await writer.xadd(stream, {"e": VALUE}, maxlen=100)
            await woken.wait()

        out["redis-wake"] = await paced(wake, count, rate) - xadd_alone
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await writer.delete(key, stream)
    finally:
        await writer.aclose()
        await reader.aclose()
    return out


async def measure_kafka(bootstrap: str, count: int, rate: float) -> dict[str, float]:
    from sluicegate.kafka import create_bare_consumer, create_bare_producer, ensure_topics

    topic = f"costs.{uuid.uuid4().hex[:8]}"
    await ensure_topics(bootstrap, {topic: 1}, 1)
    producer = create_bare_producer(bootstrap=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    out: dict[str, float] = {}
    try:
        out["kafka-produce"] = await paced(lambda: producer.send_and_wait(topic, RECORD), count, rate)
        consumer = create_bare_consumer(topic, bootstrap=bootstrap, auto_offset_reset="latest")
        await consumer.start()
        try:
            await consumer.getmany(timeout_ms=500)  # assigned, positioned at the end

            async def produce_and_fetch() -> None:
                await producer.send_and_wait(topic, RECORD)
                while not await consumer.getmany(timeout_ms=1000):
                    pass

            out["kafka-fetch"] = await paced(produce_and_fetch, count, rate) - out["kafka-produce"]
        finally:
            await consumer.stop()
    finally:
        await producer.stop()
    return out


async def measure_server(count: int, rate: float) -> dict[str, float]:
    """HTTP and WebSocket: the bare app in a uvicorn child; its CPU per request or per stream."""
    import websockets.asyncio.client

    from benchmarks.http1 import Http1Pool

    port = free_port()
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uvicorn", "benchmarks.message_costs:bare_app", "--port", str(port), "--loop", "uvloop",
        "--http", "httptools", "--ws", "websockets-sansio", "--log-level", "warning", "--no-access-log",
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    out: dict[str, float] = {}
    try:
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.1)

        async def server_cpu_per(op: Callable[[], Awaitable[Any]]) -> float:
            for _ in range(20):
                await op()
            before = process_cpu_seconds(server.pid)
            await paced(op, count, rate)
            return (process_cpu_seconds(server.pid) - before) / count

        async with Http1Pool("127.0.0.1", port, {}) as http:
            out["http"] = await server_cpu_per(
                lambda: http.post_json("/v1/requests", json.loads(BODY), clock=time.time)
            )

        async def stream() -> None:
            async with websockets.asyncio.client.connect(f"ws://127.0.0.1:{port}/v1/streams/r") as ws:
                async for _ in ws:
                    pass

        out["websocket"] = await server_cpu_per(stream)
    finally:
        server.terminate()
        await server.wait()
    return out


async def run(args: argparse.Namespace) -> dict[str, float]:
    costs: dict[str, float] = {"wake-up": await paced(_nothing, args.count, args.rate)}
    costs.update(await measure_redis(args.redis_url, args.count, args.rate))
    costs.update(await measure_kafka(args.kafka_bootstrap, args.count, args.rate))
    costs.update(await measure_server(args.count, args.rate))
    for name in _PACED_ALONE:
        costs[name] -= costs["wake-up"]
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0, help="operations per second, one at a time")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--kafka-bootstrap", help="use this Kafka (with --redis-url) instead of a private stack")
    parser.add_argument("--redis-url")
    parser.add_argument("--with-counts", action="store_true", help="also the path's messages x these costs")
    args = parser.parse_args(argv)
    use_uvloop()
    stack = None
    if args.kafka_bootstrap is None:
        # Private ports (not the pipeline benchmark's), the broker with its full JIT as there.
        stack = start_private_stack(kafka_port=29792, redis_port=26792, full_jit=True)
        args.kafka_bootstrap, args.redis_url = "127.0.0.1:29792", "redis://127.0.0.1:26792/0"
    try:
        costs = asyncio.run(run(args))
    finally:
        if stack is not None:
            stack.close()
    print(f"CPU per operation, µs ({args.count} each at {args.rate:g}/s, one at a time; load {os.getloadavg()[0]:.2f})")
    print(markdown_table(["operation", "µs CPU"], [[name, f"{1e6 * s:.0f}"] for name, s in costs.items()]))
    if args.with_counts:
        rows = []
        for service, counts in PATH_COUNTS.items():
            total = sum(n * costs[op] for op, n in counts.items())
            detail = ", ".join(f"{n:g} x {op}" for op, n in counts.items())
            rows.append([service, detail, f"{1000 * total:.2f}"])
        print("\nthe path's messages alone, per request:")
        print(markdown_table(["service", "messages", "ms CPU"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
