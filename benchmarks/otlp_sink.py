"""A local OTLP/HTTP traces endpoint for benchmarks that measure the cost of tracing: it takes every export,
decodes it (as a collector would) and counts the spans, in a process of its own so that receiving never takes
the load generator's CPU time."""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _serve(port_out: Any, spans: Any) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    reply = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            count = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with spans.get_lock():
                spans.value += count
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.value = server.server_address[1]
    server.serve_forever()


class OtlpSink:
    """``url`` to export to; ``spans`` received so far; ``close()`` stops it."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._port = context.Value("i", 0)
        self._spans = context.Value("q", 0)
        self._process = context.Process(target=_serve, args=(self._port, self._spans), daemon=True)
        self._process.start()
        while self._port.value == 0:
            if not self._process.is_alive():
                raise RuntimeError("the OTLP sink did not start")
            self._process.join(0.05)
        self.url = f"http://127.0.0.1:{self._port.value}"

    @property
    def spans(self) -> int:
        return int(self._spans.value)

    @property
    def pid(self) -> int:
        return self._process.pid or 0

    def close(self) -> None:
        self._process.terminate()
        self._process.join(5)
