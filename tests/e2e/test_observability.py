"""Observability end to end: real services exporting spans over OTLP/HTTP to a receiver inside the test (the
protobuf export decoded with opentelemetry-proto), and each process's ``/metrics`` parsed with
prometheus_client's parser after requests went through.

One trace per request: the client's ``traceparent`` -> ingress (server span, GenAI request span, Kafka producer
span) -> worker (consumer span with GenAI usage attributes, engine queue/prefill/decode children) -> result
service relay (a child of the ingress span, found through the status record); and a Kafka-native producer's
record on ``llm.inbound`` -> router -> worker.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from schemas import Names

from .conftest import Pipeline, Service, free_port
from .observability_names import dashboard_expressions, exposed_names, referenced_metrics, rule_expressions

pytestmark = pytest.mark.slow

WORKER_METRICS_PORT = free_port()
ROUTER_METRICS_PORT = free_port()
BATCH_METRICS_PORT = free_port()


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    start_ns: int = 0
    end_ns: int = 0
    event_times: dict[str, int] = field(default_factory=dict)


class Receiver:
    """An OTLP/HTTP traces endpoint collecting every exported span."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            service=resource.get("service.name", ""),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[e.name for e in span.events],
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            event_times={e.name: e.time_unix_nano for e in span.events},
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[tuple[str, str]], timeout_s: float = 30) -> list[Span]:
        """The trace once it holds every (service, span name) in ``names``: each process exports on its own
        schedule, and ingress and the worker both name a span ``chat <model>``, so a name alone is not enough."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if names <= {(s.service, s.name) for s in spans}:
                return spans
            time.sleep(0.2)
        got = {(s.service, s.name) for s in self.trace(trace_id)}
        raise AssertionError(f"trace {trace_id} lacks {names - got}: {sorted(got)}")


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def pipeline_env(receiver: Receiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # export within the test's patience
        "SLUICEGATE_WORKER_METRICS_PORT": str(WORKER_METRICS_PORT),
        "SLUICEGATE_ROUTER_METRICS_PORT": str(ROUTER_METRICS_PORT),
        "SLUICEGATE_BATCH_METRICS_PORT": str(BATCH_METRICS_PORT),
        "SLUICEGATE_BATCH_TICK_S": "0.3",  # ETA samples often enough to see it fall within a short batch
    }


def _one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def _sse_events(pipeline: Pipeline, submitted: dict[str, Any], last_id: str | None = None) -> list[dict[str, Any]]:
    params = {"token": submitted["stream_token"], **({"last_id": last_id} if last_id else {})}
    url = f"{pipeline.result_url}/v1/streams/{submitted['request_id']}/sse"
    events = []
    with httpx.stream("GET", url, params=params, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] in ("done", "error"):
                    break
    return events


def test_one_trace_spans_ingress_worker_engine_and_relay(pipeline: Pipeline, receiver: Receiver) -> None:
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = httpx.post(
        f"{pipeline.ingress_url}/v1/requests",
        json={
            "model": pipeline.model,
            "messages": [{"role": "user", "content": "trace me"}],
            "max_tokens": 6,
            "temperature": 0.5,
            "top_p": 0.9,
            "ignore_eos": True,
            "priority": "interactive",
        },
        headers={**pipeline.headers(), "traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    submitted = response.json()
    events = _sse_events(pipeline, submitted)
    assert events[-1]["type"] == "done"

    spans = receiver.wait_for(
        trace_id,
        {
            ("sluicegate-ingress", "chat tiny-e2e"),
            ("sluicegate-worker", "chat tiny-e2e"),
            ("sluicegate-result-service", "relay sse"),
        },
    )
    services = {s.service for s in spans}
    assert {"sluicegate-ingress", "sluicegate-worker", "sluicegate-result-service"} <= services

    # ingress: the HTTP server span continues the client's span; the request span and the producer span nest.
    server = next(s for s in spans if s.service == "sluicegate-ingress" and s.parent_id == client_span)
    accepted = _one(spans, "sluicegate-ingress", "chat tiny-e2e")
    assert accepted.parent_id == server.span_id
    assert accepted.attributes["gen_ai.operation.name"] == "chat"
    assert accepted.attributes["gen_ai.request.model"] == pipeline.model
    assert accepted.attributes["gen_ai.request.max_tokens"] == 6
    assert accepted.attributes["gen_ai.request.temperature"] == 0.5
    assert accepted.attributes["gen_ai.request.top_p"] == 0.9
    produced = next(s for s in spans if s.service == "sluicegate-ingress" and s.kind == 4)  # PRODUCER
    assert produced.parent_id == accepted.span_id

    # worker: a consumer span under the producer span, with the GenAI response and usage attributes.
    served = _one(spans, "sluicegate-worker", "chat tiny-e2e")
    assert served.kind == 5 and served.parent_id == produced.span_id  # CONSUMER
    attributes = served.attributes
    assert attributes["gen_ai.response.model"] == pipeline.model
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.usage.output_tokens"] == 6
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.usage.cache_read.input_tokens"] >= 0
    assert attributes["sluicegate.request_id"] == submitted["request_id"]
    # engine phases: events of the request's span at the engine's own timestamps, in order, before the span ends
    # (the engine may take a request from the intake before its span starts; 1 ms of slack for float stamps)
    phases = [served.event_times[phase] for phase in ("engine.queue", "engine.prefill", "engine.decode")]
    assert phases == sorted(phases) and phases[-1] <= served.end_ns + 1_000_000
    assert not [s.name for s in spans if s.name.startswith("engine.")]  # no child span per phase
    # the worker's Redis pickup read nests under its span (redis instrumentation)
    assert any(s.service == "sluicegate-worker" and s.kind == 3 and s.parent_id == served.span_id for s in spans)
    # the first token reaching the worker's loop for the stream append, as an event of the request's span
    assert "sluicegate.first_token.emitted" in served.events
    emitted = served.event_times["sluicegate.first_token.emitted"]
    assert served.event_times["engine.decode"] - 1_000_000 <= emitted <= served.end_ns  # after the engine made it
    # the worker's stream appends carry every request's events: none of their spans lands in this trace
    # (nor do the status-record writes of ingress and the worker)
    assert not [s.name for s in spans if s.name == "SET"]
    assert not [s.name for s in spans if "XADD" in s.name]
    # one consumer span per request at the worker (its own, with the GenAI attributes; no per-record receive span)
    assert [s.name for s in spans if s.service == "sluicegate-worker" and s.kind == 5] == [served.name]

    # result service: the relay span joins the request's trace under the ingress span.
    relay = _one(spans, "sluicegate-result-service", "relay sse")
    assert relay.parent_id == accepted.span_id
    assert relay.attributes["sluicegate.request_id"] == submitted["request_id"]


def test_kafka_native_record_is_traced_through_the_router(pipeline: Pipeline, receiver: Receiver) -> None:
    from kafka import KafkaProducer

    trace_id = uuid.uuid4().hex
    request_id = uuid.uuid4().hex
    body = {"request_id": request_id, "model": pipeline.model, "prompt": "route me", "sampling": {"max_tokens": 3}}
    producer = KafkaProducer(bootstrap_servers=pipeline.kafka_bootstrap)
    try:
        producer.send(
            Names(pipeline.prefix).inbound_topic,
            json.dumps(body).encode(),
            key=request_id.encode(),
            headers=[("traceparent", f"00-{trace_id}-{'ab' * 8}-01".encode())],
        ).get(timeout=30)
    finally:
        producer.close()
    pipeline.wait_stream_end(request_id)
    # Each process exports its spans on its own schedule: wait for the router's as well as the worker's.
    inbound = Names(pipeline.prefix).inbound_topic
    spans = receiver.wait_for(
        trace_id, {("sluicegate-router", f"process {inbound}"), ("sluicegate-worker", "text_completion tiny-e2e")}
    )
    routed = _one(spans, "sluicegate-router", f"process {inbound}")
    assert routed.parent_id == "ab" * 8
    router_send = next(s for s in spans if s.service == "sluicegate-router" and s.kind == 4)
    assert router_send.parent_id == routed.span_id
    served = _one(spans, "sluicegate-worker", "text_completion tiny-e2e")
    assert served.parent_id == router_send.span_id
    assert "engine.decode" in served.events


def _scrape(url: str) -> dict[str, Any]:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    return {"text": response.text, "families": {f.name: f for f in text_string_to_metric_families(response.text)}}


def _total(families: dict[str, Any], name: str, sample: str, **labels: str) -> float:
    family = families[name]
    return sum(
        s.value for s in family.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_every_process_exports_observations(pipeline: Pipeline) -> None:
    submitted = pipeline.submit(prompt="count me", max_tokens=4, ignore_eos=True, priority="standard")
    events = _sse_events(pipeline, submitted)
    _sse_events(pipeline, submitted, last_id=events[1]["id"])  # a resume by last_id

    worker_url = f"http://127.0.0.1:{WORKER_METRICS_PORT}"
    assert httpx.get(f"{worker_url}/healthz", timeout=5).status_code == 200
    ready = httpx.get(f"{worker_url}/readyz", timeout=5)
    assert ready.status_code == 200, ready.text

    worker = _scrape(f"{worker_url}/metrics")["families"]
    labels = {"model": pipeline.model, "tier": "standard"}
    for histogram in (
        "sluicegate:time_to_first_token_seconds",
        "sluicegate:e2e_request_latency_seconds",
        "sluicegate:request_queue_time_seconds",
        "sluicegate:request_prefill_time_seconds",
        "sluicegate:request_decode_time_seconds",
        "sluicegate:inter_token_latency_seconds",
        "sluicegate_worker_kafka_wait_seconds",
    ):
        assert _total(worker, histogram, histogram + "_count", **labels) >= 1, histogram
    assert _total(worker, "sluicegate:generation_tokens", "sluicegate:generation_tokens_total", **labels) >= 4
    assert _total(worker, "sluicegate:prompt_tokens", "sluicegate:prompt_tokens_total", **labels) >= 1
    genai = {"gen_ai_operation_name": "text_completion", "gen_ai_request_model": pipeline.model}
    for histogram in (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai_server_request_duration_seconds",
    ):
        assert _total(worker, histogram, histogram + "_count", **genai) >= 1, histogram
    assert _total(worker, "sluicegate:kv_cache_usage_perc", "sluicegate:kv_cache_usage_perc") >= 0
    assert _total(worker, "sluicegate:prefix_cache_queries", "sluicegate:prefix_cache_queries_total") > 0
    heartbeat = "sluicegate_worker_last_heartbeat_timestamp_seconds"
    assert time.time() - _total(worker, heartbeat, heartbeat, model=pipeline.model) < 30
    deadline = time.monotonic() + 10  # the backlog sampler runs every heartbeat interval
    while "sluicegate_worker_backlog_seconds" not in _scrape(f"{worker_url}/metrics")["text"]:
        assert time.monotonic() < deadline, "no backlog sample"
        time.sleep(0.3)

    relay = _scrape(f"{pipeline.result_url}/metrics")["families"]
    assert _total(relay, "sluicegate_relay_connections", "sluicegate_relay_connections_total", transport="sse") >= 2
    assert _total(relay, "sluicegate_relay_resumes", "sluicegate_relay_resumes_total", transport="sse") >= 1

    ingress = _scrape(f"{pipeline.ingress_url}/metrics")["families"]
    assert _total(ingress, "sluicegate_ingress_published", "sluicegate_ingress_published_total") >= 1

    router = _scrape(f"http://127.0.0.1:{ROUTER_METRICS_PORT}/metrics")
    assert "sluicegate_router_batch_seconds" in router["families"]


def test_dashboard_and_rules_name_only_exported_metrics(pipeline: Pipeline) -> None:
    scraped: set[str] = set()
    for url in (
        f"http://127.0.0.1:{WORKER_METRICS_PORT}/metrics",
        f"http://127.0.0.1:{ROUTER_METRICS_PORT}/metrics",
        f"{pipeline.result_url}/metrics",
        f"{pipeline.ingress_url}/metrics",
    ):
        scraped |= exposed_names(_scrape(url)["text"])
    assert referenced_metrics(dashboard_expressions() + rule_expressions()) - scraped == set()


@pytest.fixture(scope="module")
def traced_batch_worker(pipeline: Pipeline) -> Iterator[Service]:
    """A batch worker exporting spans and serving its metrics on ``BATCH_METRICS_PORT``."""
    service = pipeline.start_batch_worker("batch-worker-observed")
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{BATCH_METRICS_PORT}/metrics", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert service.alive() and time.monotonic() < deadline, service.log()
        time.sleep(0.3)
    yield service
    pipeline.kill_group(service)


def _batch_file(pipeline: Pipeline, lines: int, max_tokens: int, step: int = 0) -> str:
    """An uploaded batch file of ``lines`` chat lines; line n asks for ``max_tokens + n * step`` tokens."""
    body = "".join(
        json.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": pipeline.model,
                    "messages": [{"role": "user", "content": f"batch line {n}"}],
                    "max_tokens": max_tokens + n * step,
                    "ignore_eos": True,
                },
            }
        )
        + "\n"
        for n in range(lines)
    )
    return pipeline.openai().files.create(file=("in.jsonl", body.encode()), purpose="batch").id


def test_batch_line_is_traced_from_create_to_collection(
    pipeline: Pipeline, receiver: Receiver, traced_batch_worker: Service
) -> None:
    file_id = _batch_file(pipeline, 1, 4)
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = httpx.post(
        f"{pipeline.ingress_url}/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers={**pipeline.headers(), "traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    spans = receiver.wait_for(
        trace_id,
        {
            ("sluicegate-ingress", "POST /v1/batches"),
            ("sluicegate-worker", "chat tiny-e2e"),
            ("sluicegate-batch-worker", "collect batch line"),
        },
        timeout_s=120,
    )
    by_id = {s.span_id: s for s in spans}
    created = _one(spans, "sluicegate-ingress", "POST /v1/batches")
    assert created.parent_id == client_span
    # create -> the Celery task ingress sends (run by the batch worker, unless the beat got there first)
    sent = _one(spans, "sluicegate-ingress", "apply_async/sluicegate.batch.advance")
    assert sent.parent_id == created.span_id
    ran = [s for s in spans if s.name == "run/sluicegate.batch.advance"]
    assert all(s.service == "sluicegate-batch-worker" and s.parent_id == sent.span_id for s in ran), ran
    # -> the line's Kafka record (published by whichever task stepped the batch, in the batch's trace) -> the
    # worker's request span -> its result record -> the collector storing the line's outcome.
    published = next(s for s in spans if s.service == "sluicegate-batch-worker" and s.name.endswith(".batch send"))
    assert published.parent_id == created.span_id and published.kind == 4  # PRODUCER
    served = _one(spans, "sluicegate-worker", "chat tiny-e2e")
    assert served.parent_id == published.span_id
    collected = _one(spans, "sluicegate-batch-worker", "collect batch line")
    result_record = by_id[collected.parent_id]
    assert result_record.service == "sluicegate-worker" and result_record.name.endswith("llm.results send")
    assert result_record.parent_id == served.span_id
    batch_id = response.json()["id"]
    assert collected.attributes == {"sluicegate.batch_id": batch_id, "sluicegate.batch_line": 1}


def test_batch_worker_metrics_and_a_falling_eta(pipeline: Pipeline, traced_batch_worker: Service) -> None:
    url = f"http://127.0.0.1:{BATCH_METRICS_PORT}/metrics"
    before = _scrape(url)["families"]
    lines = 60
    client = pipeline.openai()
    batch = client.batches.create(
        # Lengths spread out (8 to 952 tokens) so lines finish over many ticks rather than all in one engine step,
        # and the ETA is recomputed several times once a tenth are done even when a busy box delays the beat.
        input_file_id=_batch_file(pipeline, lines, 8, step=16),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    seen: list[tuple[int, float]] = []  # (lines done, eta_seconds) while in progress
    deadline = time.monotonic() + 180
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.model_dump_json()
        eta = (batch.model_extra or {}).get("eta_seconds")
        counts = batch.request_counts
        done = counts.completed + counts.failed if counts is not None else 0
        if batch.status == "in_progress" and eta is not None:
            seen.append((done, float(eta)))
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch.model_dump_json()
    # The ETA is there while the batch runs. Before its first lines finish it rests on the rate of earlier work
    # (and rises while none finish); once a tenth are done, where it is scored, it falls as lines finish.
    assert seen, "no eta_seconds while the batch was in progress"
    scored = [eta for done, eta in seen if done >= lines // 10]
    changes = [eta for n, eta in enumerate(scored) if n == 0 or eta != scored[n - 1]]
    assert len(changes) >= 2 and changes[-1] < changes[0], seen

    after = _scrape(url)["families"]

    def grew(name: str, sample: str, **labels: str) -> float:
        return _total(after, name, sample, **labels) - (_total(before, name, sample, **labels) if name in before else 0)

    assert grew("sluicegate_batch_lines_enqueued", "sluicegate_batch_lines_enqueued_total") == lines
    finished = "sluicegate_batch_lines_finished_total"
    assert grew("sluicegate_batch_lines_finished", finished, outcome="completed") == lines
    assert _total(after, "sluicegate_batch_lines_in_flight", "sluicegate_batch_lines_in_flight") >= 0
    assert "sluicegate_batch_collector_lag_records" in after and "sluicegate_batch_active" in after
    # Scored against the real finish: the ETA given once a tenth of the lines were done.
    eta_error = "sluicegate_batch_eta_error_ratio"
    assert grew(eta_error, eta_error + "_count") == 1
