"""Helpers shared by the result service's integration tests: the worker's stream appends, a real uvicorn server
for a relay app, and WebSocket readers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from redis.asyncio import Redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from result_service.app import create_app
from result_service.hub import RelayConfig
from schemas import STREAM_FIELD, DoneEvent, Names, StreamEvent, TokenEvent, Usage, stream_entry_id
from sluicegate.settings import Settings
from sluicegate.stream_tokens import issue_stream_token

SECRET = "result-service-test-secret"
TENANT = "acme"


def token_events(request_id: str, start: int, count: int) -> list[StreamEvent]:
    return [
        TokenEvent(request_id=request_id, seq=seq, text=f"t{seq} ", token_ids=[seq, seq + 1000])
        for seq in range(start, start + count)
    ]


def done_event(request_id: str, seq: int) -> DoneEvent:
    usage = Usage(prompt_tokens=3, completion_tokens=seq, total_tokens=3 + seq)
    return DoneEvent(request_id=request_id, seq=seq, finish_reason="stop", usage=usage)


async def append(redis: Redis, names: Names, events: Sequence[StreamEvent]) -> None:
    """Append like the worker: one pipeline, explicit entry ids derived from seq."""
    pipe = redis.pipeline(transaction=False)
    for event in events:
        key = names.stream_key(event.request_id)
        pipe.xadd(key, {STREAM_FIELD: event.model_dump_json()}, id=stream_entry_id(event.seq))
    await pipe.execute()


@dataclass
class Running:
    settings: Settings
    names: Names
    client_name: str
    http_url: str
    ws_url: str

    def stream_url(self, request_id: str, token: str | None = None, **params: str) -> str:
        token = issue_stream_token(SECRET, request_id, TENANT, lifetime_s=3600) if token is None else token
        query = httpx.QueryParams({"token": token, **params})
        return f"{self.ws_url}/v1/streams/{request_id}?{query}"


@dataclass
class Received:
    events: list[dict[str, Any]]
    code: int | None
    reason: str


async def receive_all(ws: ClientConnection, limit: int | None = None) -> Received:
    """Messages until the server closes (or ``limit`` messages arrived)."""
    events: list[dict[str, Any]] = []
    try:
        while limit is None or len(events) < limit:
            events.append(json.loads(await ws.recv()))
    except ConnectionClosed:
        pass
    return Received(events, ws.close_code, ws.close_reason)


async def read_stream(url: str) -> Received:
    async with connect(url) as ws:
        return await receive_all(ws)


def expected_token(request_id: str, seq: int) -> dict[str, Any]:
    return {
        "type": "token",
        "seq": seq,
        "request_id": request_id,
        "text": f"t{seq} ",
        "token_ids": [seq, seq + 1000],
        "id": stream_entry_id(seq),
    }


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def count_connections(redis: Redis, client_name: str) -> int:
    clients = await redis.client_list()
    return sum(1 for c in clients if c.get("name") == client_name)


async def start_server(settings: Settings, config: RelayConfig) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    app = create_app(settings, config=config)
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, ws="websockets-sansio", log_config=None, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()[:2]
    return server, task, f"{host}:{port}"


@contextlib.asynccontextmanager
async def running_relay(settings: Settings, config: RelayConfig) -> AsyncIterator[Running]:
    """A relay app for ``settings`` served on a free port for the block's duration."""
    server, task, address = await start_server(settings, config)
    try:
        yield Running(
            settings, Names(settings.topic_prefix), config.client_name, f"http://{address}", f"ws://{address}"
        )
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


async def open_unread_websocket(url: str) -> tuple[ClientProtocol, asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket whose socket is read only when the test says so (client libraries read ahead into
    memory, which hides a stalled reader from the server)."""
    uri = parse_uri(url)
    protocol = ClientProtocol(uri)
    reader, writer = await asyncio.open_connection(uri.host, uri.port, limit=2**16)
    protocol.send_request(protocol.connect())
    writer.write(b"".join(protocol.data_to_send()))
    while protocol.handshake_exc is None and not any(isinstance(e, Response) for e in protocol.events_received()):
        protocol.receive_data(await reader.read(4096))
    assert protocol.handshake_exc is None
    return protocol, reader, writer


async def read_until_close(
    protocol: ClientProtocol, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> Received:
    events: list[dict[str, Any]] = []
    while protocol.close_rcvd is None:
        data = await reader.read(2**16)
        if not data:
            protocol.receive_eof()
            break
        protocol.receive_data(data)
        events.extend(json.loads(f.data) for f in protocol.events_received() if f.opcode is Opcode.TEXT)
        writer.write(b"".join(protocol.data_to_send()))
    writer.close()
    close = protocol.close_rcvd
    return Received(events, close.code if close else None, close.reason if close else "")


async def overflow_until_dropped(
    redis: Redis,
    names: Names,
    request_id: str,
    unread: tuple[ClientProtocol, asyncio.StreamReader, asyncio.StreamWriter],
) -> Received:
    """Append 300 large events of ``request_id`` while the client of ``unread`` reads nothing, then read what it got
    until the relay closed it: 1013 asking for a resume, after an in-order prefix of the stream."""
    big = "x" * 65536  # large frames fill the socket buffers quickly
    events = [TokenEvent(request_id=request_id, seq=seq, text=big, token_ids=[seq]) for seq in range(300)]
    for start in range(0, 300, 20):
        await append(redis, names, events[start : start + 20])
    await asyncio.sleep(0.5)  # the relay's buffer for this client overflows meanwhile
    first = await asyncio.wait_for(read_until_close(*unread), 20)
    assert first.code == 1013, (first.code, first.reason)
    assert "last_id" in first.reason
    seqs = [e["seq"] for e in first.events]
    assert seqs == list(range(len(seqs))) and 0 < len(seqs) < 300
    return first
