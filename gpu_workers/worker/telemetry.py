"""The worker's metrics and spans: the engine's numbers under vLLM's names (``sluicegate:*``), the GenAI server
metrics, the pipeline's own (time in Kafka, lag, backlog seconds, redeliveries, dead letters, heartbeats), and
one span per request continuing the trace its Kafka record carries.

The engine imports nothing of this: its gauges are read from ``engine.stats()`` at scrape time, per-request
timings come from the ``RequestMetrics`` of each request's final delta, and inter-token latency from the
``EngineFront.add_delta_observer`` hook. Everything on the hot path is a counter, a histogram observation or a
dict update; spans are made only while tracing is on (:func:`sluicegate.telemetry.tracing_enabled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpu_workers.engine import EngineFront
from gpu_workers.engine.outputs import RequestDelta, RequestMetrics
from schemas import TIERS, InferenceRequest, Tier, Usage
from sluicegate.record_check import reason_kind
from sluicegate.telemetry import context_from_headers, genai_operation, genai_request_attributes, tracing_enabled

from .backlog_seconds import GenerationRate, TokensPerRequest, backlog_seconds
from .engine_collector import EngineCollector
from .kv_tier_metrics import KVTierCollector

log = logging.getLogger(__name__)

# vLLM's request-latency buckets (seconds), so its dashboards' quantiles read the same.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
# The GenAI semantic conventions' advised boundaries for the gen_ai.server.* histograms.
GENAI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
GENAI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# Expected generated tokens of a request before any finished (the API's default max_tokens).
DEFAULT_TOKENS_PER_REQUEST = 256.0

_MT = ["model", "tier"]
_GENAI = ["gen_ai_operation_name", "gen_ai_request_model"]


class WorkerTelemetry:
    """Every metric of one worker in its own registry (served on ``SLUICEGATE_WORKER_METRICS_PORT``), the
    per-request watches, and the background sampler of lag and backlog seconds."""

    def __init__(
        self,
        engine: EngineFront,
        model: str,
        worker_id: str,
        registry: CollectorRegistry | None = None,
        *,
        queue_budget_s: float = 0.0,
        max_num_seqs: int | None = None,
    ) -> None:
        self.model = model
        self.worker_id = worker_id
        # The engine's batch size: requests that fit beside the running ones start at once (None: not counted).
        self.max_num_seqs = max_num_seqs
        # The latest sample's finite backlog seconds per tier, which the heartbeat carries to admission.
        self.backlog_seconds: dict[Tier, float] | None = None
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.registry.register(EngineCollector(engine, model))
        self.registry.register(KVTierCollector(engine, model))
        self.prompt_tokens = Counter("sluicegate:prompt_tokens", "Prompt tokens of finished requests.", _MT, registry=r)
        self.generation_tokens = Counter("sluicegate:generation_tokens", "Tokens generated.", _MT, registry=r)
        self.request_success = Counter(
            "sluicegate:request_success",
            "Requests the engine finished, by finish reason.",
            [*_MT, "finished_reason"],
            registry=r,
        )
        hist = {
            "ttft": ("sluicegate:time_to_first_token_seconds", "Engine arrival to first token.", TTFT_BUCKETS),
            "itl": (
                "sluicegate:inter_token_latency_seconds",
                "Between token deliveries.",
                ITL_BUCKETS,
            ),
            "e2e": ("sluicegate:e2e_request_latency_seconds", "Engine arrival to finish.", LATENCY_BUCKETS),
            "queue": ("sluicegate:request_queue_time_seconds", "Time waiting in the engine's queue.", LATENCY_BUCKETS),
            "prefill": ("sluicegate:request_prefill_time_seconds", "First scheduling to first token.", LATENCY_BUCKETS),
            "decode": ("sluicegate:request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS),
        }
        self._hist = {key: Histogram(n, d, _MT, buckets=b, registry=r) for key, (n, d, b) in hist.items()}
        self.genai_ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai.server.time_to_first_token: produce to Kafka to the first generated token.",
            _GENAI,
            buckets=GENAI_TTFT_BUCKETS,
            registry=r,
        )
        self.genai_tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "gen_ai.server.time_per_output_token: decode time per token after the first.",
            _GENAI,
            buckets=GENAI_TPOT_BUCKETS,
            registry=r,
        )
        self.genai_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "gen_ai.server.request.duration: produce to Kafka to the last token.",
            _GENAI,
            buckets=GENAI_DURATION_BUCKETS,
            registry=r,
        )
        self.kafka_wait = Histogram(
            "sluicegate_worker_kafka_wait_seconds",
            "Time a request spent in Kafka: produce (record timestamp) to this worker taking it.",
            _MT,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lag = Gauge(
            "sluicegate_worker_consumer_lag", "Requests on this worker's partitions not taken yet.", _MT, registry=r
        )
        self.backlog = Gauge(
            "sluicegate_worker_backlog_seconds",
            "Seconds of generation waiting at or above the tier: lag x expected tokens / tokens per second.",
            _MT,
            registry=r,
        )
        self.rate = Gauge(
            "sluicegate_worker_generation_tokens_per_second", "Measured generation rate.", ["model"], registry=r
        )
        self.redeliveries = Counter(
            "sluicegate_worker_redeliveries",
            "Requests delivered again after an owner died or gave them up, by outcome "
            "(resumed from the stream, restarted, already_finished).",
            [*_MT, "outcome"],
            registry=r,
        )
        self.fenced = Counter(
            "sluicegate_worker_fenced",
            "Requests this worker stopped because a newer owner's epoch refused its writes (a zombie's requests).",
            _MT,
            registry=r,
        )
        self.dead_letters = Counter(
            "sluicegate_dead_letters",
            "Records sent to llm.dlq, by process and reason.",
            ["service", "reason"],
            registry=r,
        )
        self.heartbeat_time = Gauge(
            "sluicegate_worker_last_heartbeat_timestamp_seconds",
            "Unix time of this worker's last successful heartbeat write.",
            ["model", "worker_id"],
            registry=r,
        )
        # The default queue-time budget, so an alert can compare backlog seconds with it (0: none).
        Gauge(
            "sluicegate_worker_queue_budget_seconds",
            "SLUICEGATE_DEFAULT_QUEUE_BUDGET_S: the queue-time budget of a request without a deadline (0: none).",
            ["model"],
            registry=r,
        ).labels(model).set(queue_budget_s)
        self.tokens_per_request = TokensPerRequest(DEFAULT_TOKENS_PER_REQUEST)
        self.generation_rate = GenerationRate()
        self._generated = 0  # plain count for the rate sampler (reading a Counter back is slower)
        self._last_delta: dict[str, tuple[Tier, float]] = {}
        self._itl = {tier: self._hist["itl"].labels(model, tier) for tier in TIERS}
        self._kafka_wait = {tier: self.kafka_wait.labels(model, tier) for tier in TIERS}
        self._tier_of_topic: dict[str, Tier] = {}
        self.tracer = trace.get_tracer("sluicegate.worker")
        engine.add_delta_observer(self._on_deltas)

    # --- hooks the worker calls ------------------------------------------------------------------------------
    def set_topics(self, tiers_by_topic: dict[str, Tier]) -> None:
        self._tier_of_topic = dict(tiers_by_topic)

    def record_taken(self, record: Any) -> None:
        """Time in Kafka, from the record's produce timestamp (milliseconds) to now."""
        tier = self._tier_of_topic.get(record.topic, "batch")
        timestamp = getattr(record, "timestamp", None)
        if timestamp and timestamp > 0:
            self._kafka_wait[tier].observe(max(0.0, time.time() - timestamp / 1000))

    def watch(self, request: InferenceRequest, record: Any) -> RequestWatch:
        """Start following one request (and its span, while tracing is on)."""
        return RequestWatch(self, request, record)

    def redelivered(self, tier: str, outcome: str) -> None:
        self.redeliveries.labels(self.model, tier, outcome).inc()

    def fenced_request(self, tier: str) -> None:
        self.fenced.labels(self.model, tier).inc()

    def dead_lettered(self, reason: str) -> None:
        self.dead_letters.labels("worker", reason_kind(reason)).inc()

    def heartbeat_written(self) -> None:
        self.heartbeat_time.labels(self.model, self.worker_id).set(time.time())

    def _on_deltas(self, deltas: list[RequestDelta]) -> None:
        now = time.perf_counter()
        last_delta = self._last_delta
        for delta in deltas:
            seen = last_delta.get(delta.request_id)
            if seen is None or not delta.token_ids:
                continue
            tier, previous = seen
            if previous > 0:
                # A delta may carry several tokens (the stream interval, speculative decoding): each counts the
                # gap's share, so the histogram stays per token whatever the interval.
                share = (now - previous) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self._itl[tier].observe(share)
            last_delta[delta.request_id] = (tier, now)

    # --- the background sampler ------------------------------------------------------------------------------
    async def sample_backlog(
        self,
        consumer: AIOKafkaConsumer,
        engine: EngineFront,
        interval_s: float,
        held: Callable[[], Mapping[Tier, int]] | None = None,
    ) -> None:
        """Every ``interval_s``: lag per tier on this worker's partitions (end offset minus the next offset it
        will fetch, plus the records ``held`` fetched and not started), the measured generation rate and the
        backlog seconds they give."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._sample_once(consumer, engine, held)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a rebalance or a broker hiccup: the next sample tries again
                log.debug("worker.backlog_sample_failed", extra={"error": repr(exc)})

    async def _sample_once(
        self, consumer: AIOKafkaConsumer, engine: EngineFront, held: Callable[[], Mapping[Tier, int]] | None = None
    ) -> None:
        stats = engine.stats()
        busy = stats.num_running > 0
        rate = self.generation_rate.sample(time.monotonic(), self._generated, busy)
        # Seats the running batch leaves: the requests queued here (in the engine, held, or still in Kafka) take
        # them first.
        free_seats = 0 if self.max_num_seqs is None else self.max_num_seqs - stats.num_running
        self.rate.labels(self.model).set(rate)
        lags = dict.fromkeys(TIERS, 0)
        for tier, count in (held() if held is not None else {}).items():
            lags[tier] += count
        assigned = list(consumer.assignment())
        if assigned:
            ends = await consumer.end_offsets(assigned)
            for tp in assigned:
                with contextlib.suppress(Exception):  # revoked meanwhile
                    lags[self._tier_of_topic.get(tp.topic, "batch")] += max(0, ends[tp] - await consumer.position(tp))
        # The engine's own queue waits too: the worker takes several batches' worth of records from Kafka at once,
        # so under load most of the backlog sits there, and a backlog of Kafka lag alone read 0 s while a hundred
        # requests waited (deadline admission could not refuse, and the backlog alerts stayed quiet).
        queued = dict(lags)
        for rank, tier in enumerate(TIERS):  # the engine's priority is the tier's rank (schemas.tier_rank)
            queued[tier] += stats.waiting_by_priority.get(rank, 0)
        published: dict[Tier, float] = {}
        expected = self.tokens_per_request.as_mapping()
        for tier, seconds in backlog_seconds(queued, expected, rate, free_seats).items():
            self.lag.labels(self.model, tier).set(lags[tier])
            self.backlog.labels(self.model, tier).set(seconds)
            if math.isfinite(seconds):
                published[tier] = seconds
        self.backlog_seconds = published


class RequestWatch:
    """One request's metrics at its end, and its span while tracing is on (a child of the context its Kafka
    record carries, with the engine's queue, prefill and decode as events built from ``RequestMetrics``)."""

    __slots__ = ("engine_metrics", "owner", "produced_at", "request", "span", "tier")

    def __init__(self, owner: WorkerTelemetry, request: InferenceRequest, record: Any) -> None:
        self.owner = owner
        self.request = request
        self.tier: Tier = request.priority
        timestamp = getattr(record, "timestamp", None)
        self.produced_at: float | None = timestamp / 1000 if timestamp and timestamp > 0 else None
        self.engine_metrics: RequestMetrics | None = None
        self.span: trace.Span | None = None
        if tracing_enabled():
            attributes = genai_request_attributes(request)
            attributes |= {
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": record.topic,
                "messaging.destination.partition.id": str(record.partition),
                "messaging.kafka.offset": record.offset,
                "sluicegate.worker_id": owner.worker_id,
            }
            self.span = owner.tracer.start_span(
                f"{attributes['gen_ai.operation.name']} {request.model}",
                context=context_from_headers(record.headers),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
            )

    def context(self) -> Any:
        """The span as the current context for the request's task (so Redis and Kafka calls nest under it)."""
        return trace.set_span_in_context(self.span) if self.span is not None else None

    def generating(self) -> None:
        """The request is in the engine: its deltas count for inter-token latency from now."""
        self.owner._last_delta[self.request.request_id] = (self.tier, 0.0)

    def engine_finished(self, metrics: RequestMetrics) -> None:
        self.engine_metrics = metrics

    def finished(self, reason: str, usage: Usage, first_output_wall: float | None = None) -> None:
        """Record the request's end: token counts, the engine's timings, the GenAI server metrics, the span's
        usage attributes and the engine's phase events, and ``first_output_wall`` (when the worker's loop took its
        first output for the stream append) as the ``sluicegate.first_token.emitted`` event."""
        owner, model, tier = self.owner, self.owner.model, self.tier
        owner.prompt_tokens.labels(model, tier).inc(usage.prompt_tokens)
        owner.generation_tokens.labels(model, tier).inc(usage.completion_tokens)
        owner._generated += usage.completion_tokens
        owner.request_success.labels(model, tier, reason).inc()
        if reason != "abort":
            owner.tokens_per_request.observe(tier, usage.completion_tokens)
        metrics = self.engine_metrics
        if metrics is not None:
            self._observe_engine(metrics, usage)
        if self.span is not None:
            self.span.set_attributes(
                {
                    "gen_ai.response.model": model,
                    "gen_ai.response.id": self.request.request_id,
                    "gen_ai.response.finish_reasons": [reason],
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                    "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
                }
            )
            if metrics is not None:
                self._engine_events(metrics)
            if first_output_wall is not None:
                # Stamped when it happened, added now: an early-started request's first token can come before its
                # span exists, so an event made as deltas arrive missed it now and then.
                self.span.add_event("sluicegate.first_token.emitted", timestamp=int(first_output_wall * 1e9))

    def failed(self, code: str) -> None:
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, code))
            self.span.set_attribute("error.type", code)

    def close(self) -> None:
        """End the span and stop inter-token tracking (also for a request handed off mid-way)."""
        self.owner._last_delta.pop(self.request.request_id, None)
        if self.span is not None:
            self.span.end()

    def _observe_engine(self, m: RequestMetrics, usage: Usage) -> None:
        hist, labels = self.owner._hist, (self.owner.model, self.tier)
        genai = (genai_operation(self.request), self.request.model)
        start = self.produced_at if self.produced_at is not None else m.arrival_time
        if m.first_scheduled_time is not None:
            hist["queue"].labels(*labels).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finish_time is not None:
            hist["e2e"].labels(*labels).observe(max(0.0, m.finish_time - m.arrival_time))
            self.owner.genai_duration.labels(*genai).observe(max(0.0, m.finish_time - start))
        # An embedding generates no token: its "first token" is the prefill's end, which would read as a TTFT and
        # skew the generation histograms. Its queue and whole time are above.
        if m.first_token_time is None or self.request.task == "embed":
            return
        hist["ttft"].labels(*labels).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            hist["prefill"].labels(*labels).observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        self.owner.genai_ttft.labels(*genai).observe(max(0.0, m.first_token_time - start))
        if m.finish_time is not None:
            hist["decode"].labels(*labels).observe(max(0.0, m.finish_time - m.first_token_time))
            if usage.completion_tokens > 1:
                per_token = (m.finish_time - m.first_token_time) / (usage.completion_tokens - 1)
                self.owner.genai_tpot.labels(*genai).observe(max(0.0, per_token))

    def _engine_events(self, m: RequestMetrics) -> None:
        """The engine's phases as events of the request's span, at the engine's own wall-clock stamps, with their
        lengths: cheaper to make and export than child spans (docs/benchmarks.md), and a phase nests nothing."""
        assert self.span is not None
        phases = (
            ("engine.queue", m.arrival_time, m.first_scheduled_time),
            ("engine.prefill", m.first_scheduled_time, m.first_token_time),
            ("engine.decode", m.first_token_time, m.finish_time),
        )
        for name, begin, end in phases:
            if begin is not None and end is not None:
                self.span.add_event(name, {"sluicegate.duration_s": end - begin}, timestamp=int(begin * 1e9))
        if m.num_preemptions:
            self.span.set_attribute("sluicegate.engine.preemptions", m.num_preemptions)
