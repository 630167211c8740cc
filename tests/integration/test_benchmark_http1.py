"""The benchmarks' lean HTTP/1.1 client against a real uvicorn server: keep-alive reuse, the send stamp, a
kept-alive connection the server closed while idle, and a streamed answer handed over piece by piece as it
arrives (what the pipeline benchmark's ``--api openai`` reads its server-sent events with)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from benchmarks.http1 import Http1Pool


@contextlib.asynccontextmanager
async def echo_server(keep_alive_s: float) -> AsyncIterator[tuple[str, int, list[str]]]:
    app = FastAPI()
    peers: list[str] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, object]:
        peers.append(f"{request.client.host}:{request.client.port}" if request.client else "")
        got = {"got": await request.json(), "auth": request.headers.get("authorization")}
        if "traceparent" in request.headers:
            got["traceparent"] = request.headers["traceparent"]
        return got

    @app.post("/drip")
    async def drip(request: Request) -> StreamingResponse:
        pieces = (await request.json())["pieces"]

        async def body() -> AsyncIterator[str]:
            for piece in pieces:
                yield piece
                await asyncio.sleep(0.3)  # apart in time, so each arrives alone

        return StreamingResponse(body(), media_type="text/event-stream")

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, timeout_keep_alive=keep_alive_s)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "server did not start"
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield "127.0.0.1", port, peers
    finally:
        server.should_exit = True
        await task


async def test_requests_reuse_one_connection_and_carry_headers() -> None:
    async with echo_server(5.0) as (host, port, peers), Http1Pool(host, port, {"Authorization": "Bearer k"}) as pool:
        for i in range(3):
            before = time.time()
            response = await pool.post_json("/echo", {"n": i}, clock=time.time)
            assert response.status == 200 and response.json() == {"got": {"n": i}, "auth": "Bearer k"}
            assert before <= response.sent_at <= time.time()
    assert len(peers) == 3 and len(set(peers)) == 1


async def test_a_request_can_add_headers_of_its_own() -> None:
    parent = "00-" + "1" * 32 + "-" + "2" * 16 + "-00"
    async with echo_server(5.0) as (host, port, _), Http1Pool(host, port, {"Authorization": "Bearer k"}) as pool:
        traced = await pool.post_json("/echo", {"n": 1}, clock=time.time, headers=[("traceparent", parent)])
        assert traced.json() == {"got": {"n": 1}, "auth": "Bearer k", "traceparent": parent}
        # Only that request: the next one on the same connection carries the pool's headers alone.
        assert (await pool.post_json("/echo", {"n": 2}, clock=time.time)).json() == {
            "got": {"n": 2},
            "auth": "Bearer k",
        }


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async with echo_server(0.2) as (host, port, peers), Http1Pool(host, port) as pool:
        assert (await pool.post_json("/echo", {"n": 1}, clock=time.time)).status == 200
        await asyncio.sleep(0.6)  # past the server's keep-alive: it closes the connection
        assert (await pool.post_json("/echo", {"n": 2}, clock=time.time)).json()["got"] == {"n": 2}
    assert len(peers) == 2 and peers[0] != peers[1]


async def test_a_server_that_is_gone_is_an_error() -> None:
    async with echo_server(5.0) as (host, port, _):
        pass
    async with Http1Pool(host, port) as pool:
        with pytest.raises(OSError):
            await pool.post_json("/echo", {}, clock=time.time)


async def test_a_streamed_answer_is_handed_over_as_it_arrives() -> None:
    async with echo_server(5.0) as (host, port, _), Http1Pool(host, port) as pool:
        got: list[tuple[bytes, float]] = []
        response = await pool.post_json(
            "/drip",
            {"pieces": ["data: 1\n\n", "data: 2\n\n"]},
            clock=time.monotonic,
            on_data=lambda b, t: got.append((b, t)),
        )
        assert response.status == 200 and response.body == b""
        assert [b for b, _ in got] == [b"", b"data: 1\n\n", b"data: 2\n\n"]  # the head first, then each piece
        # Stamped on arrival, not when the answer ended (a late stamp of piece 1 on a busy box shortens the gap).
        assert got[2][1] - got[1][1] >= 0.15
        again = await pool.post_json("/echo", {"n": 1}, clock=time.monotonic)  # the connection is reused after it
        assert again.json()["got"] == {"n": 1}
