"""A small HTTP endpoint for processes that have no web app of their own (the worker, the router stream
processor): ``GET /metrics`` (Prometheus text), ``/healthz`` (the process answers) and ``/readyz`` (200 only
while a readiness callback says so; the Helm chart's readiness probe).

It runs on the process's own event loop (``asyncio.start_server``); a scrape renders the registry in a thread
so custom collectors that read engine state never hold the loop for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, str]]


class MetricsServer:
    """Serves ``registry`` and the probes on ``host:port`` until :meth:`close`."""

    def __init__(
        self, registry: CollectorRegistry, port: int, *, host: str = "0.0.0.0", ready: Readiness | None = None
    ) -> None:
        self.registry = registry
        self.port = port
        self.host = host
        self.ready = ready or (lambda: (True, "ready"))
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        sockets = self._server.sockets or ()
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("metrics.listening host=%s port=%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing here depends on them
            parts = request_line.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            status, content_type, body = await self._answer(method, path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + (body if method != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path == "/metrics":
            body = await asyncio.to_thread(generate_latest, self.registry)
            return "200 OK", CONTENT_TYPE_LATEST, body
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            ok, why = self.ready()
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", why.encode() + b"\n"
        return "404 Not Found", "text/plain", b"not found\n"
