"""The one telemetry bootstrap every Sluicegate process calls: OpenTelemetry tracing over OTLP, configured by
the standard ``OTEL_*`` variables, and the helpers each hop uses to continue one trace per request.

Tracing is on only when an OTLP traces endpoint is configured: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as
is), else ``OTEL_EXPORTER_OTLP_ENDPOINT`` or its alias ``SLUICEGATE_OTLP_ENDPOINT`` (``/v1/traces`` appended);
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off. Headers, timeout and compression come
from the exporter's own ``OTEL_EXPORTER_OTLP_*`` variables. Off, nothing is installed and the hot paths check
:func:`tracing_enabled` before making any span object: a client's ``traceparent`` is still carried along
(:func:`child_traceparent`), as a string.

On, :func:`configure_tracing` installs the global tracer provider (``service.name`` per service) and the
instrumentation packages for aiokafka (producer spans; ``traceparent`` injected into record headers) and Redis
(one span per command or pipeline). Client calls made outside any request (heartbeats, consumer polls) would
each start a trace of their own; the sampler drops such parentless CLIENT/PRODUCER/CONSUMER spans, so a trace
is a request. Work that serves many requests at once (the worker's batched stream appends, the relay's wake-ups
of its shared reader) runs under :func:`untraced`, so its span never lands in whichever request's trace
happened to start it. (Skipping the instrumentation's wrapper outside a request was measured too: within noise,
about 20 us per parentless pipeline, so it is not done; docs/benchmarks.md.)

Celery (the batch tasks) joins the same way: in the Celery app module, call
``configure_tracing("sluicegate-batch-worker")`` and then :func:`instrument_celery` from a
``celery.signals.worker_process_init`` handler (each prefork child needs its own exporter thread), and
``configure_tracing("<caller>")`` + :func:`instrument_celery` in the process that sends tasks.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import SpanKind

from schemas import InferenceRequest, TraceContext
from schemas.names import HEADER_TRACEPARENT, HEADER_TRACESTATE

log = logging.getLogger(__name__)

# Paths whose requests get no HTTP server span: probes and scrapes, and the result service's stream relays
# (a browser's WebSocket sends no traceparent, so that span was a trace of its own per connection; the relay's
# span, in the request's own trace, covers the connection: result_service/telemetry.py).
EXCLUDED_URLS = "healthz,readyz,metrics,v1/streams"

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-([0-9a-f]{2})$")

_provider: TracerProvider | None = None
_celery_instrumented = False
_kafka_injects = False


def otlp_traces_endpoint(alias: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The OTLP/HTTP traces URL the ``OTEL_*`` variables (or ``alias``, ``SLUICEGATE_OTLP_ENDPOINT``) give;
    empty when tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return ""
    explicit = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if explicit:
        return explicit
    base = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or alias.strip()).rstrip("/")
    if not base:
        return ""
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class _RequestRootsOnly(Sampler):
    """Roots a trace only at a SERVER or INTERNAL span (a request arriving, or a process's own unit of work);
    a parentless client, producer or consumer span is background traffic and is dropped. Of the request roots,
    the fraction ``ratio`` is kept, chosen by trace id (so every process decides alike)."""

    _KEEP = frozenset({SpanKind.SERVER, SpanKind.INTERNAL})

    def __init__(self, ratio: float = 1.0) -> None:
        self._ratio = TraceIdRatioBased(ratio) if ratio < 1.0 else None

    def should_sample(  # type: ignore[override]
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Any = None,
        links: Sequence[Any] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if kind is not None and kind not in self._KEEP:
            return SamplingResult(Decision.DROP)
        if self._ratio is not None:
            return self._ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return "RequestRootsOnly" if self._ratio is None else f"RequestRootsOnly{{{self._ratio.rate}}}"


def root_sample_ratio() -> float:
    """The fraction of request traces kept, from the standard ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``:
    ``traceidratio`` and ``parentbased_traceidratio`` take the ratio (default 1.0), ``always_off`` and
    ``parentbased_always_off`` give 0, anything else (the default ``parentbased_always_on``) 1. A trace that
    arrives with a sampled parent (a client's ``traceparent``) is always followed, as ``ParentBased`` does."""
    name = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if name in {"always_off", "parentbased_always_off"}:
        return 0.0
    if name not in {"traceidratio", "parentbased_traceidratio"}:
        return 1.0
    raw = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
    try:
        ratio = float(raw)
    except ValueError:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number between 0 and 1, got {raw!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be between 0 and 1, got {ratio}")
    return ratio


class _HashedOnce(Resource):
    """A resource that computes its hash once. The OTLP encoder groups every exported span by resource, and
    ``Resource.__hash__`` serialises all the attributes to JSON each time: a fifth of the export thread's CPU
    (py-spy, docs/benchmarks.md). A resource never changes, so its hash need not either."""

    _hash: int = 0

    @classmethod
    def of(cls, resource: Resource) -> _HashedOnce:
        made = cls(resource.attributes, resource.schema_url)
        made._hash = Resource.__hash__(made)
        return made

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return other is self or super().__eq__(other)


def configure_tracing(service_name: str, alias_endpoint: str | None = None) -> bool:
    """Install tracing for this process if an endpoint is configured; True when tracing is on.

    Idempotent (the first call's service name stays). ``alias_endpoint`` defaults to
    ``SLUICEGATE_OTLP_ENDPOINT``. Instruments aiokafka and Redis process-wide.
    """
    global _provider
    if _provider is not None:
        return True
    if alias_endpoint is None:
        alias_endpoint = os.environ.get("SLUICEGATE_OTLP_ENDPOINT", "")
    endpoint = otlp_traces_endpoint(alias_endpoint)
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(
        resource=_HashedOnce.of(Resource.create({"service.name": service_name})),
        sampler=ParentBased(root=_RequestRootsOnly(root_sample_ratio())),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _provider = provider
    _instrument_clients(provider)
    log.info("telemetry.tracing_on service=%s endpoint=%s", service_name, endpoint)
    return True


def _instrument_clients(provider: TracerProvider) -> None:
    # The standard switch of OpenTelemetry's Python auto-instrumentation, e.g. "redis" to drop the span per
    # Redis call (most of the spans, and of tracing's CPU cost: docs/benchmarks.md).
    disabled = {n.strip() for n in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
    if "aiokafka" not in disabled:
        import aiokafka
        from opentelemetry.instrumentation.aiokafka import AIOKafkaInstrumentor
        from opentelemetry.instrumentation.utils import unwrap

        AIOKafkaInstrumentor().instrument(tracer_provider=provider)
        # Keep the producer side (the PRODUCER span, traceparent injected into the record's headers) but not the
        # consumer's "receive" span per record: the worker and the router open their own consumer span per
        # record, from its headers, with the GenAI and messaging attributes, so that one was a second span per
        # request on the worker's hot path saying less.
        unwrap(aiokafka.AIOKafkaConsumer, "getone")
        unwrap(aiokafka.AIOKafkaConsumer, "getmany")
        global _kafka_injects
        _kafka_injects = True
    if "redis" not in disabled:
        from opentelemetry.instrumentation.redis import RedisInstrumentor

        RedisInstrumentor().instrument(tracer_provider=provider)


def untraced() -> AbstractContextManager[Any]:
    """A block whose client calls make no spans: for work that serves many requests at once (one Redis pipeline
    carrying several requests' events), whose span would otherwise join whichever request's context started it.
    A no-op while tracing is off."""
    if _provider is None:
        return nullcontext()
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    return suppress_instrumentation()


def instrument_celery() -> None:
    """Trace Celery task publishing and execution (opentelemetry-instrumentation-celery); a no-op while
    tracing is off. Call after :func:`configure_tracing`, in each process that sends or runs tasks."""
    global _celery_instrumented
    if _provider is None or _celery_instrumented:
        return
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument(tracer_provider=_provider)
    _celery_instrumented = True


def instrument_app(app: Any) -> None:
    """Server spans for a FastAPI app's requests (opentelemetry-instrumentation-fastapi) when tracing is on.
    Probes and scrapes are excluded, and so are the per-message send/receive spans (no span per token)."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=_provider, excluded_urls=EXCLUDED_URLS, exclude_spans=["receive", "send"]
    )


def tracing_enabled() -> bool:
    """Whether spans are being made and exported in this process."""
    return _provider is not None


def kafka_injects_trace() -> bool:
    """Whether the aiokafka instrumentation puts the trace context into produced records' headers."""
    return _kafka_injects


def shutdown_tracing() -> None:
    """Export what is buffered and stop; for processes that leave through ``os._exit`` (no atexit hooks)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    """A tracer of this process's provider (the no-op one while tracing is off)."""
    return trace.get_tracer(name)


# --- carrying the context between hops ------------------------------------------------------------------------


def child_traceparent(incoming: str | None) -> str:
    """A ``traceparent`` for this hop while tracing is off: the caller's trace id (or a new one) with a new span
    id and the caller's flags, made without any span object, so downstream logs still share the trace id."""
    match = _TRACEPARENT.match(incoming) if incoming else None
    if match is not None and match[1] != "0" * 32:
        return f"00-{match[1]}-{secrets.token_hex(8)}-{match[2]}"
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def valid_traceparent(value: str | None) -> bool:
    """Whether ``value`` is a W3C ``traceparent`` a hop may pass on: the format, a version other than ff, and
    trace and span ids that are not all zeros. An invalid one is dropped, with its ``tracestate`` (W3C: restart
    the trace rather than propagate garbage)."""
    if not value:
        return False
    match = _TRACEPARENT.match(value)
    return match is not None and not value.startswith("ff") and match[1] != "0" * 32 and value[36:52] != "0" * 16


def context_from_headers(headers: Sequence[tuple[str, bytes]] | None) -> otel_context.Context:
    """The trace context a Kafka record carries (the first ``traceparent``/``tracestate`` headers)."""
    carrier: dict[str, str] = {}
    for key, value in headers or ():
        if key in (HEADER_TRACEPARENT, HEADER_TRACESTATE) and key not in carrier and value:
            carrier[key] = value.decode("latin-1")
    return propagate.extract(carrier)


def context_from_traceparent(traceparent: str | None, tracestate: str | None = None) -> otel_context.Context:
    """The trace context a stored ``traceparent`` names (an empty context for None)."""
    carrier = {HEADER_TRACEPARENT: traceparent} if traceparent else {}
    if traceparent and tracestate:
        carrier[HEADER_TRACESTATE] = tracestate
    return propagate.extract(carrier)


def current_trace() -> TraceContext | None:
    """The current span's context as a request's ``trace`` field (None while tracing is off or no span is
    current): for work that starts later, elsewhere, as part of this trace (a batch's lines)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if HEADER_TRACEPARENT not in carrier:
        return None
    return TraceContext(traceparent=carrier[HEADER_TRACEPARENT], tracestate=carrier.get(HEADER_TRACESTATE))


@contextmanager
def attached(ctx: otel_context.Context) -> Iterator[None]:
    """Make ``ctx`` current for the block (instrumented Kafka and Redis calls inside become its children)."""
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


# --- GenAI semantic conventions --------------------------------------------------------------------------------

GENAI_PROVIDER = "sluicegate"


def genai_operation(request: InferenceRequest) -> str:
    """``gen_ai.operation.name``: ``embeddings`` for an embedding, ``chat`` for a message list, ``text_completion``
    for a prompt."""
    if request.task == "embed":
        return "embeddings"
    return "chat" if request.messages else "text_completion"


def genai_request_attributes(request: InferenceRequest) -> dict[str, Any]:
    """The request-side GenAI attributes (operation, model, sampling parameters) of a pipeline request."""
    sampling = request.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": genai_operation(request),
        "gen_ai.provider.name": GENAI_PROVIDER,
        "gen_ai.request.model": request.model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "sluicegate.request_id": request.request_id,
        "sluicegate.tier": request.priority,
    }
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    if sampling.stop:
        attributes["gen_ai.request.stop_sequences"] = list(sampling.stop)
    return attributes
