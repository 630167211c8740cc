"""A lean HTTP/1.1 keep-alive client for load generators: h11 over asyncio streams, nothing else.

A general-purpose client (httpx) spends most of a millisecond per request in Python before the first
byte leaves and again after the last one arrives; a benchmark that stamps "request sent" before calling
it charges that time to the server. Here the stamp is taken as the request's bytes are written, and the
client's own work per request is a few dozen microseconds, so the figures describe the server.
"""

from __future__ import annotations

import asyncio
import json
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


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    async def request(self, data: bytes, clock: Any) -> Response:
        sent_at = clock()
        self.writer.write(data)
        status, chunks = 0, []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                received = await self.reader.read(65536)
                if not received:
                    raise ConnectionError("server closed the connection mid-response")
                self.h11.receive_data(received)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
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

    async def post_json(self, path: str, body: Any, *, clock: Any) -> Response:
        """POST ``body`` as JSON; ``clock()`` stamps the moment the bytes are written."""
        payload = json.dumps(body).encode()
        conn = self._idle.pop() if self._idle else await self._open()
        request = h11.Request(
            method="POST",
            target=path,
            headers=[*self._headers, ("Content-Type", "application/json"), ("Content-Length", str(len(payload)))],
        )
        data = conn.h11.send(request) + conn.h11.send(h11.Data(data=payload)) + conn.h11.send(h11.EndOfMessage())
        try:
            response = await conn.request(data, clock)
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
