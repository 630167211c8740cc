"""The pipeline benchmark's load and meters: open-loop Poisson arrivals that POST a request and follow its
stream over the WebSocket (``native``: the result service relays it), or POST a streamed OpenAI completion and
read its server-sent events from ingress (``openai``: the path the OpenAI SDK takes), stamping bytes as they
arrive; ingress's own timers from ``/metrics``, CPU time per process, and the transport floor (Kafka and a
Redis stream alone, at the same pace).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from websockets.protocol import State
from websockets.uri import parse_uri

from benchmarks import relay
from benchmarks.common import percentile, process_cpu_seconds
from benchmarks.http1 import Http1Pool
from benchmarks.pipeline_stack import API_KEY, MODEL_NAME, Stack
from sluicegate.settings import Settings

#: Which way the load generator talks to the pipeline: ``native`` POST + WebSocket relay, or ``openai`` streamed
#: completions from ingress.
Api = Literal["native", "mux", "openai"]
ROUTES: dict[Api, str] = {"native": "/v1/requests", "mux": "/v1/requests", "openai": "/v1/completions"}
#: What each way is, as the report says it.
API_PATHS: dict[Api, str] = {
    "native": "POST /v1/requests, then the stream over the result service's WebSocket",
    "mux": "POST /v1/requests, then the stream on one multiplexed WebSocket of the result service (/v1/streams) that "
    "follows every request of the run",
    "openai": "POST /v1/completions with stream=true, its server-sent events relayed by ingress (the 'relay' "
    "stage ends at ingress's SSE chunk; 'POST' is the response head; the ingress handler lasts the whole stream)",
}


@dataclass
class Sample:
    """One request as the client saw it (``time.time()`` seconds)."""

    sent: float = 0.0
    accepted: float = 0.0
    first: float = 0.0
    done: float = 0.0
    lateness: float = 0.0
    request_id: str = ""
    tokens: int = 0
    error: str | None = None
    #: With ``mixed_tracing``: whether the request's traceparent asked for it to be traced (sampled flag).
    traced: bool | None = None


class _Followed:
    """One request's stream as a client reads it: events in order, the first token's and the end's arrival."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.next_seq = 0

    def on_event(self, event: dict[str, Any], now: float) -> bool:
        """Account for one event; True when it ended the stream."""
        sample = self.sample
        if event["seq"] != self.next_seq and sample.error is None:
            sample.error = f"seq {event['seq']} where {self.next_seq} was due"
        self.next_seq = event["seq"] + 1
        if event["type"] == "token":
            sample.first = sample.first or now
            sample.tokens += len(event["token_ids"])
        elif event["type"] in ("done", "error"):
            sample.done = now
            if event["type"] == "error":
                sample.error = f"error event: {event.get('code')}: {event.get('message')}"
            return True
        return False


class _StreamReader(relay.SansIOWebSocket):
    """Follows one request's stream, stamping events as their bytes arrive, so the client's own scheduling
    delays do not count as pipeline latency."""

    clock = staticmethod(time.time)

    def __init__(self, url: str, sample: Sample) -> None:
        super().__init__(url)
        self.sample = sample
        self.followed = _Followed(sample)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_text(self, data: str | bytes, now: float) -> None:
        self.followed.on_event(json.loads(data), now)

    def on_handshake_failed(self, message: str) -> None:
        if self.sample.error is None:
            self.sample.error = message

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.sample.done and self.sample.error is None:
            close = self.ws.close_rcvd
            self.sample.error = f"connection closed before done (close {close.code if close else None}, {exc!r})"
        if not self.closed.done():
            self.closed.set_result(None)


class MuxReader(relay.SansIOWebSocket):
    """One multiplexed socket (``/v1/streams``) following every request of a run, each stamped as its bytes
    arrive."""

    clock = staticmethod(time.time)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.followed: dict[str, tuple[_Followed, asyncio.Future[None]]] = {}
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.opened.done() and self.ws.state is State.OPEN:
            self.opened.set_result(None)

    def follow(self, request_id: str, token: str, sample: Sample) -> asyncio.Future[None]:
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.followed[request_id] = (_Followed(sample), ended)
        message = {"type": "subscribe", "request_id": request_id, "token": token}
        self.ws.send_text(json.dumps(message).encode())
        self._flush()
        return ended

    def on_text(self, data: str | bytes, now: float) -> None:
        event = json.loads(data)
        rid = event.get("request_id")
        if rid not in self.followed:
            return
        followed, ended = self.followed[rid]
        if event["type"] in ("closed", "invalid"):
            followed.sample.error = f"{event['type']}: {event}"
            done = True
        else:
            done = followed.on_event(event, now)
        if done:
            del self.followed[rid]
            ended.set_result(None)

    def on_handshake_failed(self, message: str) -> None:
        if not self.opened.done():
            self.opened.set_exception(RuntimeError(message))

    def connection_lost(self, exc: Exception | None) -> None:
        lost = exc or ConnectionError("the multiplexed socket closed")
        for followed, ended in self.followed.values():
            followed.sample.error = followed.sample.error or f"multiplexed socket lost: {lost!r}"
            if not ended.done():
                ended.set_result(None)
        self.followed.clear()


async def open_mux(url: str) -> MuxReader:
    """A multiplexed socket open at ``url`` (``ws://host:port/v1/streams``), ready to follow requests."""
    uri = parse_uri(url)
    _, reader = await asyncio.get_running_loop().create_connection(lambda: MuxReader(url), uri.host, uri.port)
    await asyncio.wait_for(reader.opened, 10)
    return reader


async def submit_and_follow(
    client: Http1Pool, body: dict[str, Any], sample: Sample, timeout_s: float, mux: MuxReader | None = None
) -> None:
    headers = None
    if sample.traced is not None:
        # A caller's traceparent: the services' parent-based sampler follows its sampled flag (01 or 00).
        flags = "01" if sample.traced else "00"
        headers = [("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}")]
    try:
        response = await client.post_json("/v1/requests", body, clock=time.time, headers=headers)
        sample.sent = response.sent_at  # as the bytes are written, so no client library time counts
        sample.accepted = time.time()
        if response.status != 202:
            sample.error = f"POST answered {response.status}: {response.body[:200]!r}"
            return
        submitted = response.json()
        sample.request_id = submitted["request_id"]
        if mux is not None:
            await asyncio.wait_for(mux.follow(sample.request_id, submitted["stream_token"], sample), timeout_s)
            return
        url = f"{submitted['stream_url']}?token={submitted['stream_token']}"
        uri = parse_uri(url)
        loop = asyncio.get_running_loop()
        _, reader = await loop.create_connection(lambda: _StreamReader(url, sample), uri.host, uri.port)
        await asyncio.wait_for(reader.closed, timeout_s)
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: h11's protocol errors, bad JSON
        sample.error = sample.error or repr(exc)


class _SseReader:
    """Reads a streamed ``/v1/completions`` answer as its bytes arrive: the first chunk with a choice is the
    first token, ``[DONE]`` the end; the request id is the completion id without its ``cmpl-`` prefix, and the
    tokens come from the closing usage chunk.

    Ingress sends a chunk for a token with text, or with logprobs when asked for: without ``logprobs`` a first
    token whose text the detokenizer holds back (part of a character, as the tiny random model often draws) shows
    up with the next one."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self._buffer = b""

    def __call__(self, data: bytes, now: float) -> None:
        sample = self.sample
        if not data:
            sample.accepted = now
            return
        self._buffer += data
        *frames, self._buffer = self._buffer.split(b"\n\n")
        for frame in frames:
            payload = frame.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                sample.done = now
                continue
            if not payload:
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                sample.error = sample.error or f"error chunk: {chunk['error']}"
                continue
            sample.request_id = sample.request_id or chunk["id"].removeprefix("cmpl-")
            if chunk.get("choices"):
                sample.first = sample.first or now
            if chunk.get("usage"):
                sample.tokens = chunk["usage"]["completion_tokens"]


async def _one_openai_request(client: Http1Pool, body: dict[str, Any], sample: Sample, timeout_s: float) -> None:
    reader = _SseReader(sample)
    openai_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        response = await asyncio.wait_for(
            client.post_json("/v1/completions", openai_body, clock=time.time, on_data=reader), timeout_s
        )
        sample.sent = response.sent_at
        if response.status != 200:
            sample.error = f"POST answered {response.status}"
        elif not sample.done and sample.error is None:
            sample.error = "the stream ended without [DONE]"
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: h11's protocol errors, bad JSON
        sample.error = sample.error or repr(exc)


def _arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (seconds) over ``duration_s``."""
    offsets, t = [], rng.expovariate(rate)
    while t < duration_s:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


#: Starts request number ``i``, ``lateness`` seconds behind its arrival: its sample and the coroutine that fills it.
Launch = Callable[[int, float], tuple[Sample, Coroutine[Any, Any, None]]]


async def open_loop(rate: float, duration_s: float, rng: random.Random, launch: Launch) -> list[Sample]:
    """Poisson arrivals at ``rate`` for ``duration_s``, each started by ``launch`` whatever the earlier ones are doing
    (an open loop: a slow server gets the same arrivals); returns once every request ended."""
    samples: list[Sample] = []
    tasks = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i, offset in enumerate(_arrivals(rate, duration_s, rng)):
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sample, request = launch(i, max(0.0, loop.time() - start - offset))
        samples.append(sample)
        tasks.append(asyncio.create_task(request))
    if tasks:
        await asyncio.wait(tasks)
    return samples


async def run_rate(
    stack: Stack,
    rate: float,
    duration_s: float,
    *,
    max_tokens: int,
    seed: int,
    label: str = "",
    mixed_tracing: bool = False,
    api: Api = "native",
    logprobs: int | None = None,
) -> list[Sample]:
    """Open-loop arrivals at ``rate`` for ``duration_s``; returns once every request ended (or timed out).

    ``mixed_tracing``: every other request carries a traceparent asking to be traced, the rest one asking not to
    be, so one run compares the two under the same machine load."""
    rng = random.Random(f"{seed}-{rate}-{label}")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    host, port = stack.ingress_url.removeprefix("http://").rsplit(":", 1)
    mux = await open_mux(stack.result_url.replace("http://", "ws://") + "/v1/streams") if api == "mux" else None
    async with Http1Pool(host, int(port), headers) as client:

        def launch(i: int, lateness: float) -> tuple[Sample, Coroutine[Any, Any, None]]:
            sample = Sample(lateness=lateness, traced=i % 2 == 0 if mixed_tracing else None)
            # Different prompts spread the requests over partitions (the router keys on the prompt prefix).
            body = {
                "model": MODEL_NAME,
                "prompt": f"{label}request {i}: the quick brown fox",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                **({} if logprobs is None else {"logprobs": logprobs}),
            }
            if api == "openai":
                return sample, _one_openai_request(client, body, sample, timeout_s=60)
            return sample, submit_and_follow(client, body, sample, timeout_s=60, mux=mux)

        samples = await open_loop(rate, duration_s, rng, launch)
    if mux is not None and mux.transport is not None:
        mux.transport.close()
    return samples


async def ingress_timers(stack: Stack, api: Api = "native") -> dict[str, tuple[float, int]]:
    """Ingress's own timers from ``/metrics``: (sum of seconds, count) of the Kafka publish (until every
    in-sync replica acknowledged) and of the ``POST`` handling (``/v1/requests``, or ``/v1/completions`` whose
    handling lasts until its stream ends)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{stack.ingress_url}/metrics")).text
    wanted = {
        "publish": ("sluicegate_ingress_publish_seconds", {}),
        "handler": ("sluicegate_ingress_request_seconds", {"route": ROUTES[api], "method": "POST"}),
    }
    timers = {}
    for name, (family_name, labels) in wanted.items():
        total, count = 0.0, 0
        for family in text_string_to_metric_families(text):
            if family.name != family_name:
                continue
            for sample in family.samples:
                if any(sample.labels.get(k) != v for k, v in labels.items()):
                    continue
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += int(sample.value)
        timers[name] = (total, count)
    return timers


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (all its threads), and of this client process."""
    used = {}
    for name, pid in pids.items():
        try:
            used[name] = process_cpu_seconds(pid)
        except OSError:
            continue
    times = os.times()
    used["clients"] = times.user + times.system
    return used


#: The floor's Kafka clients: the delivery guarantees the pipeline keeps, and nothing the project tunes.
FLOOR_PRODUCER: dict[str, Any] = {"client_id": "floor-producer", "acks": "all", "enable_idempotence": True}
FLOOR_CONSUMER: dict[str, Any] = {
    "client_id": "floor-consumer",
    "group_id": None,
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    "isolation_level": "read_committed",
}


@dataclass
class TransportFloor:
    """The two transports alone, on the same Kafka and Redis, at the same pace as one request each."""

    kafka_ms: list[float]
    redis_ms: list[float]

    def p(self, q: float) -> tuple[float, float, float]:
        kafka, redis = percentile(self.kafka_ms, q), percentile(self.redis_ms, q)
        return kafka, redis, kafka + redis


async def measure_transport_floor(settings: Settings, *, messages: int, rate: float) -> TransportFloor:
    """What the broker and the stream cost with nothing else in the way: one record produced with the same
    guarantees as ingress's (``acks=all``, idempotent) until a consumer long-polling the partition holds it, and one
    XADD until a blocked XREAD has it; ``messages`` of each at ``rate`` per second.

    The clients are this benchmark's own, with fixed settings (:data:`FLOOR_PRODUCER`, :data:`FLOOR_CONSUMER`, the
    aiokafka and redis-py defaults otherwise, made by the bare factories, which add only the Kafka security), not the
    tuned factories: tuning the pipeline's clients must move the pipeline's figures, never the floor they are
    compared with."""
    import redis.asyncio as aioredis

    from sluicegate.kafka import create_bare_consumer, create_bare_producer, ensure_topics

    topic = f"{settings.topic_prefix}floor.{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings.kafka_bootstrap, {topic: 1}, settings.topic_replication, settings=settings)
    producer = create_bare_producer(settings, **FLOOR_PRODUCER)
    consumer = create_bare_consumer(topic, settings=settings, **FLOOR_CONSUMER)
    redis_w, redis_r = aioredis.Redis.from_url(settings.redis_url), aioredis.Redis.from_url(settings.redis_url)
    await producer.start()
    await consumer.start()
    sent: dict[bytes, float] = {}
    kafka_ms: list[float] = []
    redis_ms: list[float] = []
    stream = f"{settings.topic_prefix}floor:{uuid.uuid4().hex[:8]}"

    async def consume() -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batch.values():
                for record in records:
                    if record.value in sent:
                        kafka_ms.append(1000 * (now - sent[record.value]))

    async def read_stream() -> None:
        last = "$"
        while True:
            reply = await redis_r.xread({stream: last}, block=1000)
            now = time.perf_counter()
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    redis_ms.append(1000 * (now - float(fields[b"t"])))

    readers = [asyncio.create_task(consume()), asyncio.create_task(read_stream())]
    try:
        await asyncio.sleep(1.0)  # both readers parked: the consumer at the log end, XREAD blocked
        for i in range(messages):
            value = f"floor-{i}".encode()
            sent[value] = time.perf_counter()
            await (await producer.send(topic, value, key=value))
            await asyncio.sleep(1 / (2 * rate))
            await redis_w.xadd(stream, {"t": repr(time.perf_counter())})
            await asyncio.sleep(1 / (2 * rate))
        await asyncio.sleep(0.5)
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await consumer.stop()
        await producer.stop()
        await redis_w.delete(stream)
        await redis_w.aclose()
        await redis_r.aclose()
    return TransportFloor(kafka_ms, redis_ms)
