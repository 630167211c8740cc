"""A lean HTTP/1.1 keep-alive client for load generators: h11 over asyncio streams, nothing else.

A general-purpose client (httpx) spends most of a millisecond per request in Python before the first
byte leaves and again after the last one arrives; a benchmark that stamps "request sent" before calling
it charges that time to the server. Here the stamp is taken as the request's bytes are written, and the
client's own work per request is a few dozen microseconds, so the figures describe the server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11


@dataclass
class Response:
    status: int
    body: bytes
    sent_at: float  # the caller's clock when the request's bytes were written

    def json(self) -> Any:
        return json.loads(self.body)


#: Called with each piece of a streamed body (``b""`` first, when the response head arrives) and the caller's
#: clock at its arrival.
OnData = Callable[[bytes, float], None]


class _StaleConnection(ConnectionError):
    """The server had closed this kept-alive connection before the request reached it."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.served = 0  # requests answered on this connection: a stale one is always a reused one
        self.answered = False

    async def request(self, data: bytes, clock: Any, on_data: OnData | None = None) -> Response:
        self.answered = False
        sent_at = clock()
        self.writer.write(data)
        status, chunks = 0, []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                try:
                    received = await self.reader.read(65536)
                except ConnectionResetError as exc:
                    if self.answered or not self.served:
                        raise
                    raise _StaleConnection("connection reset before any answer") from exc
                if not received:
                    if not self.answered and self.served:
                        raise _StaleConnection("server closed the idle connection")
                    raise ConnectionError("server closed the connection mid-response")
                self.answered = True
                self.h11.receive_data(received)
            elif isinstance(event, h11.Response):
                status = event.status_code
                if on_data is not None:
                    on_data(b"", clock())  # the head: a streamed answer's "accepted"
            elif isinstance(event, h11.Data):
                if on_data is not None:
                    on_data(bytes(event.data), clock())  # stamped as it arrives, not when the answer ends
                else:
                    chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.served += 1
                return Response(status, b"".join(chunks), sent_at)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("server closed the connection")

    def reusable(self) -> bool:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        self.writer.close()


class Http1Pool:
    """Keep-alive connections to one ``host:port``; one request per connection at a time."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self._host, self._port = host, port
        self._headers = [("Host", f"{host}:{port}"), *(headers or {}).items()]
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def post_json(
        self,
        path: str,
        body: Any,
        *,
        clock: Any,
        headers: list[tuple[str, str]] | None = None,
        on_data: OnData | None = None,
    ) -> Response:
        """POST ``body`` as JSON; ``clock()`` stamps the moment the bytes are written. With ``on_data`` the body
        is streamed to it as it arrives (the returned ``Response.body`` is then empty).

        A kept-alive connection the server closed while it sat idle (uvicorn drops them after 5 s) fails
        before any answer arrives; the request then goes once more, on a new connection.
        """
        payload = json.dumps(body).encode()
        headers = [
            *self._headers,
            *(headers or ()),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
        ]
        while self._idle:
            conn = self._idle.pop()
            if conn.reader.at_eof():
                self._discard(conn)
                continue
            try:
                return await self._send(conn, path, headers, payload, clock, on_data)
            except _StaleConnection:
                continue
        return await self._send(await self._open(), path, headers, payload, clock, on_data)

    async def _send(
        self,
        conn: _Connection,
        path: str,
        headers: list[tuple[str, str]],
        payload: bytes,
        clock: Any,
        on_data: OnData | None,
    ) -> Response:
        request = h11.Request(method="POST", target=path, headers=headers)
        data = conn.h11.send(request) + conn.h11.send(h11.Data(data=payload)) + conn.h11.send(h11.EndOfMessage())
        try:
            response = await conn.request(data, clock, on_data)
        except BaseException:
            self._discard(conn)
            raise
        if conn.reusable():
            self._idle.append(conn)
        else:
            self._discard(conn)
        return response

    async def _open(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        conn = _Connection(reader, writer)
        self._all.add(conn)
        return conn

    def _discard(self, conn: _Connection) -> None:
        self._all.discard(conn)
        conn.close()

    async def aclose(self) -> None:
        for conn in list(self._all):
            self._discard(conn)
        self._idle.clear()

    async def __aenter__(self) -> Http1Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
