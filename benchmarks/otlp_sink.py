"""A local OTLP/HTTP traces endpoint for benchmarks that measure the cost of tracing: it takes every export,
decodes it (as a collector would) and counts the spans, by service and span name, in a process of its own so
that receiving never takes the load generator's CPU time."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.sharedctypes
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock
from typing import Any


def _serve(port_out: Any, spans: Any) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    reply = ExportTraceServiceResponse().SerializeToString()
    names: Counter[str] = Counter()
    names_lock = Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            seen: Counter[str] = Counter()
            for resource in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource.resource.attributes if a.key == "service.name"), "?"
                )
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        seen[f"{service} | {span.name}"] += 1
            with spans.get_lock():
                spans.value += sum(seen.values())
            with names_lock:
                names.update(seen)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def do_GET(self) -> None:  # the spans received so far, by "service | span name"
            with names_lock:
                body = json.dumps(dict(names)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.value = server.server_address[1]
    server.serve_forever()


class OtlpSink:
    """``url`` to export to; ``spans`` received so far; ``by_name()`` their counts; ``close()`` stops it."""

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

    def by_name(self) -> dict[str, int]:
        """Spans received so far by ``"service | span name"`` (empty if the sink does not answer)."""
        try:
            with urllib.request.urlopen(self.url, timeout=5) as response:
                counts: dict[str, int] = json.loads(response.read())
        except OSError:
            return {}
        return counts

    @property
    def pid(self) -> int:
        return self._process.pid or 0

    def close(self) -> None:
        self._process.terminate()
        self._process.join(5)
