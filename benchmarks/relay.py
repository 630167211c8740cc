"""Relay throughput and latency of the result service: many WebSocket clients on streams a producer fills.

The result service runs in its own process (as deployed, under uvicorn); this process runs the
producer and the clients. The producer appends token events the way a worker does (one pipelined
round trip per step, explicit entry ids); every client checks it gets each event once and in order.

Two modes per client count:

* ``max``: the producer appends ``--tokens`` events per stream in pipelined batches as fast as
  Redis takes them; the figure is total events delivered to all clients per second, from the first
  append to the last receipt. Latency here includes queueing behind the backlog.
* ``paced``: every stream gets one token per ``--step-ms`` (a decode step), like a worker serving
  that many sequences; latency from XADD to client receipt is the figure (p50/p99).

Run: ``python -m benchmarks.relay`` (starts a throwaway Redis through the dev-stack API; or pass ``--redis-url``).
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri

from benchmarks.common import (
    free_port,
    markdown_table,
    percentile,
    process_cpu_seconds,
    start_private_stack,
    use_uvloop,
)
from schemas import STREAM_FIELD, DoneEvent, Names, TokenEvent, Usage, stream_entry_id
from sluicegate.redis_client import create_redis, wait_for_redis
from sluicegate.settings import Settings
from sluicegate.stream_tokens import issue_stream_token

SECRET = "relay-benchmark-secret"
TENANT = "bench"


# --- processes -----------------------------------------------------------------------------------------


def _serve(settings_json: str, readers: int) -> None:
    import uvicorn

    from result_service.hub import RelayConfig
    from result_service.server import uvicorn_config
    from sluicegate.logs import configure_logging

    configure_logging("WARNING")
    settings = Settings.model_validate_json(settings_json)
    config = uvicorn_config(settings, config=RelayConfig(readers=readers), host="127.0.0.1")
    uvicorn.Server(config).run()


def _wait_http(url: str, process: multiprocessing.process.BaseProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise SystemExit(f"result service exited with code {process.exitcode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"result service did not answer at {url}")


def _health(base_url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{base_url}/healthz", timeout=5) as response:
        return json.loads(response.read())


# --- one run -------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    mode: str
    clients: int
    streams: int
    tokens: int
    batch: int
    step_ms: float


@dataclass
class Outcome:
    scenario: Scenario
    delivered: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0
    clients_cpu_s: float = 0.0
    redis_connections: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the latencies, in ms."""
        return percentile(self.latencies, q) * 1000


@dataclass
class ClientResult:
    stream: int
    delivered: int = 0
    #: (seq, receipt time on CLOCK_MONOTONIC, which every process on the host shares)
    samples: list[tuple[int, float]] = field(default_factory=list)
    last_at: float = 0.0
    error: str | None = None


class SansIOWebSocket(asyncio.Protocol, abc.ABC):
    """A WebSocket client on websockets' sans-I/O protocol. Frames are handled right in
    ``data_received``, without a task switch per message, so the clients cost less CPU than the relay
    they measure (they share the machine with it). Subclasses handle text frames in ``on_text``, stamped
    with ``clock()`` taken as the bytes arrived, and report a failed handshake in ``on_handshake_failed``."""

    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = ClientProtocol(parse_uri(url), max_size=2**20)
        self.transport: Any = None  # uvloop's transports do not subclass asyncio.Transport

    @abc.abstractmethod
    def on_text(self, data: str | bytes, now: float) -> None:
        """One text frame (one relayed JSON event)."""

    @abc.abstractmethod
    def on_handshake_failed(self, message: str) -> None:
        """The server refused the WebSocket upgrade."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.ws.send_request(self.ws.connect())
        self._flush()

    def data_received(self, data: bytes) -> None:
        now = self.clock()
        self.ws.receive_data(data)
        for event in self.ws.events_received():
            if isinstance(event, Frame) and event.opcode is Opcode.TEXT:
                self.on_text(event.data, now)
        if self.ws.handshake_exc is not None:
            self.on_handshake_failed(f"handshake failed: {self.ws.handshake_exc}")
        self._flush()

    def eof_received(self) -> None:
        self.ws.receive_eof()
        self._flush()

    def _flush(self) -> None:
        for chunk in self.ws.data_to_send():
            if chunk:
                self.transport.write(chunk)
            elif self.transport.can_write_eof():
                self.transport.write_eof()


class _Client(SansIOWebSocket):
    """Reads one stream to its end, checking that every event comes once and in order."""

    def __init__(self, url: str, stream: int, expected: int, sample_every: int) -> None:
        super().__init__(url)
        self.result = ClientResult(stream)
        self.expected = expected
        self.sample_every = sample_every
        self.closed: asyncio.Future[ClientResult] = asyncio.get_running_loop().create_future()

    def on_text(self, data: str | bytes, now: float) -> None:
        result = self.result
        if result.error:
            return
        seq = json.loads(data)["seq"]
        if seq != result.delivered:
            result.error = f"{self.url}: got seq {seq}, expected {result.delivered}"
            return
        if seq % self.sample_every == 0:
            result.samples.append((seq, now))
        result.delivered += 1
        result.last_at = now

    def on_handshake_failed(self, message: str) -> None:
        if not self.result.error:
            self.result.error = f"{self.url}: {message}"

    def connection_lost(self, exc: Exception | None) -> None:
        result = self.result
        close = self.ws.close_rcvd
        if not result.error and (close is None or close.code != 1000 or result.delivered != self.expected):
            code = close.code if close else None
            result.error = f"{self.url}: {result.delivered} events, expected {self.expected} (close {code}, {exc})"
        if not self.closed.done():
            self.closed.set_result(result)


async def _client(stream: int, url: str, expected: int, sample_every: int) -> ClientResult:
    """Read one stream to its end, checking that every event comes once and in order."""
    uri = parse_uri(url)
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(lambda: _Client(url, stream, expected, sample_every), uri.host, uri.port)
    return await client.closed


async def _client_group(jobs: list[tuple[int, str]], expected: int, sample_every: int, conn: Connection) -> None:
    tasks = []
    for i, (stream, url) in enumerate(jobs):
        tasks.append(asyncio.create_task(_client(stream, url, expected, sample_every)))
        if i % 50 == 49:
            await asyncio.sleep(0.02)  # no connect storm
    conn.send("connecting")
    cpu_before = time.process_time()
    results = await asyncio.gather(*tasks)
    conn.send((results, time.process_time() - cpu_before))


def _client_process(jobs: list[tuple[int, str]], expected: int, sample_every: int, conn: Connection) -> None:
    """One process of clients: in one process, the clients rather than the relay would saturate a core."""
    use_uvloop()
    asyncio.run(_client_group(jobs, expected, sample_every, conn))


def _payloads(request_id: str, tokens: int) -> list[str]:
    events: list[TokenEvent | DoneEvent] = [
        TokenEvent(request_id=request_id, seq=seq, text=f" tok{seq}", token_ids=[seq % 32000]) for seq in range(tokens)
    ]
    usage = Usage(prompt_tokens=16, completion_tokens=tokens, total_tokens=16 + tokens)
    events.append(DoneEvent(request_id=request_id, seq=tokens, finish_reason="length", usage=usage))
    return [event.model_dump_json() for event in events]


async def _produce(
    redis: Redis, keys: Sequence[str], payloads: Sequence[list[str]], sent_at: Sequence[list[float]], sc: Scenario
) -> None:
    total = len(payloads[0])
    seq = 0
    next_step = time.monotonic()
    while seq < total:
        upto = min(total, seq + sc.batch)
        pipe = redis.pipeline(transaction=False)
        for key, events in zip(keys, payloads, strict=True):
            for s in range(seq, upto):
                pipe.xadd(key, {STREAM_FIELD: events[s]}, id=stream_entry_id(s))
        now = time.monotonic()
        for stamps in sent_at:
            for s in range(seq, upto):
                stamps[s] = now
        await pipe.execute()
        seq = upto
        if sc.step_ms:
            next_step += sc.step_ms / 1000
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))


async def run_scenario(
    sc: Scenario, redis_url: str, base_http: str, server_pid: int, prefix: str, client_procs: int
) -> Outcome:
    names = Names(prefix)
    redis = create_redis(url=redis_url, client_name="relay-bench-producer")
    run = uuid.uuid4().hex[:6]
    request_ids = [f"bench-{run}-{i}" for i in range(sc.streams)]
    keys = [names.stream_key(rid) for rid in request_ids]
    payloads = [_payloads(rid, sc.tokens) for rid in request_ids]
    expected = sc.tokens + 1
    sent_at = [[0.0] * expected for _ in request_ids]
    outcome = Outcome(sc, 0, 0.0)
    sample_every = max(1, (sc.clients * expected) // 200_000)
    base_ws = base_http.replace("http://", "ws://")

    jobs = []
    for i in range(sc.clients):
        rid = request_ids[i % sc.streams]
        # A token as long-lived as a whole scenario could take.
        token = issue_stream_token(SECRET, rid, TENANT, lifetime_s=3600)
        jobs.append((i % sc.streams, f"{base_ws}/v1/streams/{rid}?token={token}"))
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    try:
        for k in range(client_procs):
            parent, child = context.Pipe()
            process = context.Process(
                target=_client_process, args=(jobs[k::client_procs], expected, sample_every, child), daemon=True
            )
            process.start()
            pipes.append(parent)
            processes.append(process)
        for pipe in pipes:
            await asyncio.to_thread(pipe.recv)
        deadline = time.monotonic() + 60
        while _health(base_http)["subscribers"] < sc.clients:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {_health(base_http)['subscribers']} of {sc.clients} clients subscribed")
            await asyncio.sleep(0.1)

        cpu_before = process_cpu_seconds(server_pid)
        started = time.monotonic()
        producer = asyncio.create_task(_produce(redis, keys, payloads, sent_at, sc))
        await asyncio.sleep(0.3)
        info = await redis.client_list()
        outcome.redis_connections = sum(1 for c in info if c.get("name") == "sluicegate-result")
        await producer
        results: list[ClientResult] = []
        for pipe in pipes:
            group, cpu_s = await asyncio.to_thread(pipe.recv)
            results.extend(group)
            outcome.clients_cpu_s += cpu_s
        outcome.seconds = max(r.last_at for r in results) - started
        outcome.server_cpu_s = process_cpu_seconds(server_pid) - cpu_before
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
    for r in results:
        outcome.delivered += r.delivered
        outcome.latencies.extend(t - sent_at[r.stream][seq] for seq, t in r.samples)
        if r.error:
            outcome.errors.append(r.error)
    await redis.delete(*keys)
    await redis.aclose()
    return outcome


# --- report --------------------------------------------------------------------------------------------


def _table(outcomes: Sequence[Outcome]) -> str:
    header = [
        "mode",
        "clients",
        "streams",
        "events/stream",
        "delivered",
        "seconds",
        "events/s to clients",
        "p50 ms",
        "p99 ms",
        "server CPU %",
        "clients CPU %",
        "service Redis conns",
    ]
    rows = []
    for o in outcomes:
        sc = o.scenario
        rows.append(
            [
                sc.mode,
                str(sc.clients),
                str(sc.streams),
                str(sc.tokens + 1),
                f"{o.delivered:,}",
                f"{o.seconds:.2f}",
                f"{o.rate:,.0f}",
                f"{o.percentile(0.5):.1f}",
                f"{o.percentile(0.99):.1f}",
                f"{100 * o.server_cpu_s / o.seconds:.0f}",
                f"{100 * o.clients_cpu_s / o.seconds:.0f}",
                str(o.redis_connections),
            ]
        )
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    parser.add_argument("--clients", default="100,500", help="comma-separated client counts")
    parser.add_argument("--clients-per-stream", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2000, help="token events per stream in max mode")
    parser.add_argument("--batch", type=int, default=20, help="events per stream per pipeline in max mode")
    parser.add_argument("--paced-tokens", type=int, default=300, help="token events per stream in paced mode")
    parser.add_argument("--step-ms", type=float, default=20.0, help="decode step of paced mode")
    parser.add_argument("--modes", default="max,paced")
    parser.add_argument("--readers", type=int, default=1, help="relay reader tasks (RelayConfig.readers)")
    parser.add_argument("--client-procs", type=int, default=2, help="processes the clients are spread over")
    args = parser.parse_args(argv)

    use_uvloop()
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    private = None
    redis_url = args.redis_url
    if redis_url is None:
        # Redis only, on free ports, with its state in the throwaway work folder.
        private = start_private_stack(free_port(), free_port(), state_dir=workdir, services=("redis",))
        redis_url = private.info.redis_url
    asyncio.run(wait_for_redis(redis_url, 15))

    port = free_port()
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    settings = Settings(redis_url=redis_url, result_port=port, stream_token_secret=SECRET, topic_prefix=prefix)
    server = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(settings.model_dump_json(), args.readers), daemon=True
    )
    server.start()
    base_http = f"http://127.0.0.1:{port}"
    outcomes: list[Outcome] = []
    try:
        _wait_http(f"{base_http}/healthz", server)
        assert server.pid is not None
        for mode in args.modes.split(","):
            for clients in (int(c) for c in args.clients.split(",")):
                streams = max(1, clients // args.clients_per_stream)
                if mode == "max":
                    sc = Scenario(mode, clients, streams, args.tokens, args.batch, 0.0)
                else:
                    sc = Scenario(mode, clients, streams, args.paced_tokens, 1, args.step_ms)
                outcome = asyncio.run(run_scenario(sc, redis_url, base_http, server.pid, prefix, args.client_procs))
                outcomes.append(outcome)
                print(
                    f"{mode:>5} clients={clients} events/s={outcome.rate:,.0f} "
                    f"p50={outcome.percentile(0.5):.1f}ms p99={outcome.percentile(0.99):.1f}ms",
                    file=sys.stderr,
                    flush=True,
                )
                for error in outcome.errors[:5]:
                    print(f"  error: {error}", file=sys.stderr)
    finally:
        server.terminate()
        server.join(10)
        if private is not None:
            private.close()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\nrelay benchmark on {os.cpu_count()} CPUs (server, Redis and clients share them)\n")
    print(_table(outcomes))
    return 1 if any(o.errors for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
