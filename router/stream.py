"""The router stream processor: validates what Kafka-native producers put on ``llm.inbound``, routes each
valid request for a served model to ``llm.<model>.<tier>`` and sends everything else to ``llm.dlq`` with a
``reason`` header. A record naming a LoRA adapter (as its model, or in ``adapter``) goes to its base model's topic
with ``adapter`` set (:mod:`sluicegate.lora.resolve`, as ingress resolves it); an unknown or invisible adapter is
``unknown_model``, one named with another base model ``invalid_adapter``. A request over its tenant's token quota
is dead-lettered as ``insufficient_quota`` (its tokens are reserved here otherwise, :mod:`sluicegate.usage.quota`);
one whose deadline the backlog its model's workers report cannot meet, as ``deadline_unmeetable``
(:func:`router.policy.deadline_unmeetable`, as ingress's 429). The process also runs the usage rollup
(:mod:`sluicegate.usage.rollup`) beside the routing loop. With tenants apart it reads each tenant's own inbound
topic instead, and a record's tenant is its topic's (:mod:`router.tenant_inbound`).

Offsets are committed only after every record of a batch has been acknowledged where it went, so a
crash re-routes (at least once) rather than loses. A bad message never stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord, RecordMetadata, TopicPartition
from opentelemetry.trace import SpanKind
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import InferenceRequest, WorkerHeartbeat
from schemas.names import HEADER_TRACEPARENT, HEADER_TRACESTATE
from sluicegate.api.errors import ApiError
from sluicegate.api.prompt_tokens import ModelTokenizers, ModelTokenizerView
from sluicegate.kafka import create_consumer, create_producer, rewind_batch
from sluicegate.lora.registry import LoRARegistry
from sluicegate.lora.resolve import AdapterResolver
from sluicegate.metrics_http import MetricsServer
from sluicegate.record_check import Rejection, dead_letter, header, reason_kind, request_id_of, validate_record
from sluicegate.redis_client import create_redis
from sluicegate.settings import RouterSettings
from sluicegate.task_stop import cancel_and_wait
from sluicegate.telemetry import (
    configure_tracing,
    context_from_headers,
    shutdown_tracing,
    tracer,
    tracing_enabled,
    valid_traceparent,
)
from sluicegate.usage.quota import QuotaClaim, Quotas, claim_for
from sluicegate.usage.rollup import keep_rolling_up

from .heartbeats import HeartbeatCache
from .kv_follower import KVFollower
from .kv_index import KVIndex
from .metrics import RouterMetrics
from .policy import deadline_unmeetable
from .publish import TopicRegistry, request_headers, send_routed
from .refusal_events import RefusalEvents
from .route_table import RouteTable
from .router import Router
from .tenant_inbound import TenantInbound

log = logging.getLogger(__name__)


def _trace_carrier(record: ConsumerRecord) -> dict[str, str]:
    """The record's trace context to pass on: none for a malformed ``traceparent`` (its ``tracestate`` goes too)."""
    traceparent = header(record.headers, HEADER_TRACEPARENT)
    if not valid_traceparent(traceparent):
        return {}
    assert traceparent is not None
    carrier = {HEADER_TRACEPARENT: traceparent}
    if tracestate := header(record.headers, HEADER_TRACESTATE):
        carrier[HEADER_TRACESTATE] = tracestate
    return carrier


def _prompt_ids(view: ModelTokenizerView | None, request: InferenceRequest) -> list[int] | None:
    """The prompt's token ids as the worker will see them (None without a tokenizer, or one that refuses it)."""
    try:
        return view.encode_request(request) if view is not None else None
    except Exception:  # a template's own refusal: routed on the key, the worker reports it
        return None


def _too_large(exc: MessageSizeTooLargeError) -> str:
    return f"the routed record is larger than Kafka takes: {exc}"


class RouterProcessor:
    """Consumes ``llm.inbound`` batch by batch; see the module docstring for the guarantees.

    Besides the reasons of :func:`sluicegate.record_check.validate_record` it dead-letters ``unknown_model``
    (no live worker, not in ``served_models``; or an unknown adapter), ``invalid_adapter`` (an adapter of another
    base model than the record's ``model``), ``deadline_unmeetable`` (its deadline is sooner than the workers'
    backlog), ``insufficient_quota`` (over its tenant's token quota; a record's ``key_id`` is not checked: the keys
    file is ingress's), ``record_too_large`` (its routed copy is larger than the producer or the broker takes) and
    ``routing_failed`` (an unexpected error routing one record).
    """

    def __init__(
        self,
        settings: RouterSettings,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        redis: Redis | None,
        *,
        retry_backoff_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self.names = settings.names
        self.inbound = TenantInbound.from_settings(settings)
        self.consumer = consumer
        self.producer = producer
        self.metrics = RouterMetrics()
        # Routing on the cached prefix: the workers' KV events, and their tokenizers to hash a prompt's blocks.
        kv = settings.kv_events and redis is not None
        self.kv_index = KVIndex(settings.router_kv_index_max_blocks) if kv else None
        self.kv_follower = KVFollower(settings, self.kv_index, service="router") if self.kv_index else None
        self.tokenizers = ModelTokenizers(redis, self.names) if kv and redis is not None else None
        self.router = Router.from_settings(settings, self.kv_index, self.metrics.registry)
        self.topics = TopicRegistry(
            settings,
            self.names,
            self.router,
            partitions=settings.topic_partitions,
            replication=settings.topic_replication,
            timeout_s=max(settings.kafka_timeout_s, 10.0),
        )
        self.heartbeats = (
            HeartbeatCache(redis, self.names, max_age_s=3 * settings.heartbeat_interval_s) if redis else None
        )
        # The routes, fast paths and canary rollbacks ingress applies, kept current by ``_watch_routes``.
        self.route_table = RouteTable(settings.routes_file, redis=redis, names=self.names)
        self.served_models = settings.served_model_names
        self.quotas = Quotas(redis, self.names) if redis is not None else None
        # Adapter names as models, from a briefly cached snapshot of the LoRA registry (no Redis read per record).
        self.adapters = (
            AdapterResolver(LoRARegistry(redis, settings.topic_prefix), ttl_s=settings.lora_cache_ttl_s)
            if redis is not None
            else None
        )
        # A refused record's stream readers hear why (when its id can be read), beside the dead letter.
        self.refusals = RefusalEvents(redis, self.names, ttl_s=settings.stream_ttl_s) if redis is not None else None
        self._refused: list[Rejection] = []  # the batch's refusals so far
        self.retry_backoff_s = retry_backoff_s
        self.routed = 0
        self.dead_lettered = 0
        self.tracer = tracer("sluicegate.router")

    async def _live_heartbeats(self, model: str) -> list[WorkerHeartbeat] | None:
        """The model's live heartbeats; None when Redis cannot tell."""
        if self.heartbeats is None:
            return None
        try:
            return await self.heartbeats.get(model)
        except (RedisError, OSError) as exc:
            log.warning("router.heartbeats_unavailable model=%s error=%r", model, exc)
            return None

    async def _check(self, record: ConsumerRecord) -> tuple[InferenceRequest, list[WorkerHeartbeat]] | Rejection:
        outcome = validate_record(record.value, record.headers)
        if not isinstance(outcome, Rejection):
            outcome = self.inbound.claim(outcome, record.topic)
        if isinstance(outcome, Rejection):
            return outcome
        if self.adapters is not None:
            try:
                outcome = await self.adapters.resolve_request(outcome)
            except ApiError as exc:  # an unknown (404) or mismatched (400) adapter: the record's fault
                reason = "unknown_model" if exc.status == 404 else "invalid_adapter"
                return Rejection(reason, exc.message, outcome.request_id)
            except (RedisError, OSError) as exc:
                raise ConnectionError(f"Redis did not answer the LoRA registry: {exc!r}") from exc
        # A Kafka-native request naming a routed public model goes to the version ingress would choose.
        choice = self.route_table.resolve(outcome)
        if choice is not None:
            self.metrics.route_versions.labels(choice.route, choice.version, choice.reason).inc()
            outcome = outcome.model_copy(update={"model": choice.version})
        beats = await self._live_heartbeats(outcome.model)
        # Same rule as ingress's 404: creating topics for any model name a producer sends would let a typo
        # (or a flood of them) litter the cluster. Without Redis the key alone decides: still correct.
        if beats is not None and not beats and outcome.model not in self.served_models:
            return Rejection(
                "unknown_model", f"model {outcome.model!r} has no live worker and is not served", outcome.request_id
            )
        if (unmeetable := deadline_unmeetable(outcome, outcome.priority, beats or [])) is not None:
            return Rejection("deadline_unmeetable", unmeetable, outcome.request_id)
        claim = claim_for(outcome, self.settings)
        if claim is not None and (refused := await self._reserve(claim)) is not None:
            return Rejection("insufficient_quota", refused, outcome.request_id)
        return outcome, beats or []

    async def _reserve(self, claim: QuotaClaim) -> str | None:
        """Reserve a request's tokens (again, for a re-read record: charged once); why not, when over a quota.
        Without Redis the batch fails and is retried: a quota is never skipped."""
        if self.quotas is None:
            return None
        try:
            refusal = await self.quotas.reserve(claim)
        except (RedisError, OSError) as exc:
            raise ConnectionError(f"Redis did not answer the quota check: {exc!r}") from exc
        return None if refusal is None else refusal.message()

    async def _dispatch(self, record: ConsumerRecord) -> asyncio.Future[RecordMetadata]:
        if not tracing_enabled():
            return await self._dispatch_one(record)
        # The record's own trace continues here; the instrumented send below nests under this span.
        with self.tracer.start_as_current_span(
            f"process {record.topic}",
            context=context_from_headers(record.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": record.topic,
                "messaging.kafka.offset": record.offset,
            },
        ):
            return await self._dispatch_one(record)

    async def _dispatch_one(self, record: ConsumerRecord) -> asyncio.Future[RecordMetadata]:
        outcome = await self._check(record)
        if not isinstance(outcome, Rejection):
            try:
                return await self._route(record, *outcome)
            except MessageSizeTooLargeError as exc:  # the record's fault: retried, it would never fit
                await self._release(outcome[0].request_id)
                outcome = Rejection("record_too_large", _too_large(exc), outcome[0].request_id)
            except (KafkaError, TimeoutError, OSError):
                raise  # the backbone failed, not the record: the batch is retried
            except Exception as exc:
                log.exception("router.route_failed offset=%s partition=%s", record.offset, record.partition)
                await self._release(outcome[0].request_id)
                outcome = Rejection("routing_failed", repr(exc), outcome[0].request_id)
        return await self._dead_letter(outcome, record)

    async def _release(self, request_id: str) -> None:
        """A request that will not run gives its reserved tokens back (a replay reserves anew)."""
        if self.quotas is not None:
            with contextlib.suppress(RedisError, OSError):
                await self.quotas.release(request_id)

    async def _dead_letter(self, outcome: Rejection, record: ConsumerRecord) -> asyncio.Future[RecordMetadata]:
        outcome = dataclasses.replace(outcome, tenant=self.inbound.tenant_of(record.topic))
        value, headers = dead_letter(outcome, record)
        log.info(
            "router.dead_letter reason=%s request_id=%s offset=%s partition=%s detail=%s",
            outcome.reason,
            outcome.request_id,
            record.offset,
            record.partition,
            outcome.detail,
        )
        self.dead_lettered += 1
        self.metrics.dead_letters.labels("router", reason_kind(outcome.reason)).inc()
        self._refused.append(outcome)  # its stream hears of it once the batch is committed (refusal_events.py)
        return await self.producer.send(
            self.inbound.dlq_topic(record.topic), value=value, key=record.key, headers=headers
        )

    async def _lora_int_id(self, request: InferenceRequest) -> int | None:
        """The adapter's registry id (its KV chain seed), from the snapshot ``_check`` resolved it with; None (the
        adapter rules alone decide) when there is none or Redis cannot tell."""
        if request.adapter is None or self.adapters is None:
            return None
        try:
            return await self.adapters.lora_int_id(request.adapter)
        except (RedisError, OSError):
            return None

    async def _route(
        self, record: ConsumerRecord, request: InferenceRequest, beats: list[WorkerHeartbeat]
    ) -> asyncio.Future[RecordMetadata]:
        await self.topics.ensure_model(request.model)
        self.router.set_heartbeats(request.model, beats)
        view = await self.tokenizers.get(request.model) if self.tokenizers and request.task != "embed" else None
        prompt_ids = _prompt_ids(view, request)
        route = self.router.route(request, prompt_ids=prompt_ids, lora_int_id=await self._lora_int_id(request))
        log.debug(
            "router.routed request_id=%s topic=%s partition=%s reason=%s",
            request.request_id,
            route.topic,
            route.partition,
            route.reason,
        )
        future = await send_routed(self.producer, request, route, request_headers(request, _trace_carrier(record)))
        self.routed += 1
        self.metrics.routed.labels(request.model, request.priority, route.reason).inc()
        return future

    async def process(self, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Route or dead-letter every record, wait for all acks, then commit past the batch."""
        started = time.perf_counter()
        self._refused = []
        sent: list[tuple[ConsumerRecord, asyncio.Future[RecordMetadata]]] = []
        for records in batch.values():
            for record in records:
                sent.append((record, await self._dispatch(record)))
        results = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        # A routed copy the broker refused for its size (its message.max.bytes is below the producer's limit) is
        # the record's fault too: dead-lettered (the letter is cut to fit), not retried forever with the batch.
        letters = []
        for (record, _), result in zip(sent, results, strict=True):
            if isinstance(result, MessageSizeTooLargeError):
                request_id = request_id_of(record.value, record.headers)
                rejection = Rejection("record_too_large", _too_large(result), request_id)
                if rejection.request_id is not None:
                    await self._release(rejection.request_id)
                letters.append(await self._dead_letter(rejection, record))
            elif isinstance(result, BaseException):
                raise result
        await asyncio.gather(*letters)
        offsets = {tp: records[-1].offset + 1 for tp, records in batch.items() if records}
        if offsets:
            await self.consumer.commit(offsets)
        if self.refusals is not None and self._refused:
            await self.refusals.tell(self._refused)
        self.metrics.batch_seconds.observe(time.perf_counter() - started)

    async def _watch_routes(self, stop: asyncio.Event) -> None:
        """Check the routing file and the shared rollbacks every ``routes_reload_s``, beside the routing loop
        (so a slow Redis or a large tokenizer to load never holds a batch up)."""
        while not stop.is_set():
            try:
                await self.route_table.refresh()
            except Exception:  # keep watching: the last good routes stay in force meanwhile
                log.exception("router.routes_check_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.routes_reload_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Loop until ``stop`` is set; a failed batch is re-read from its first offset after a pause."""
        watch = asyncio.create_task(self._watch_routes(stop))
        try:
            await self._loop(stop)
        finally:
            await cancel_and_wait(watch)

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            batch = await self.consumer.getmany(timeout_ms=500, max_records=500)
            if not batch:
                continue
            try:
                await self.process(batch)
            except (KafkaError, TimeoutError, OSError) as exc:
                self.metrics.batch_failures.inc()
                log.error("router.batch_failed records=%d error=%r; retrying", sum(map(len, batch.values())), exc)
                rewind_batch(self.consumer, batch)
                try:
                    await asyncio.wait_for(stop.wait(), self.retry_backoff_s)
                except TimeoutError:
                    pass


async def run_router(settings: RouterSettings, *, stop: asyncio.Event | None = None) -> None:
    """Run the router stream processor until ``stop`` is set (forever when None).

    Creates the inbound topics and their DLQs if missing (``llm.inbound`` and ``llm.dlq``, or each tenant's) and
    joins consumer group ``<prefix><router_group>``, so several routers share the inbound partitions.
    """
    stop = stop or asyncio.Event()
    configure_tracing("sluicegate-router", settings.otlp_endpoint)
    names = settings.names
    inbound = TenantInbound.from_settings(settings)  # before any client: a missing tenant list stops it here
    producer = create_producer(settings, client_id="sluicegate-router")
    group = f"{names.prefix}{settings.router_group}"
    consumer = create_consumer(*inbound.topics, group_id=group, settings=settings, client_id="sluicegate-router")
    redis = create_redis(settings, socket_timeout=5.0, client_name="sluicegate-router")
    processor = RouterProcessor(settings, consumer, producer, redis)
    rollup = asyncio.create_task(keep_rolling_up(settings, redis, stop)) if settings.usage_rollup else None
    server = await _start_metrics(settings, processor)
    if processor.kv_follower is not None:
        processor.kv_follower.start()
    await processor.topics.ensure(dict.fromkeys(inbound.topics_to_create, settings.topic_partitions))
    await producer.start()
    try:
        await consumer.start()
        try:
            log.info("router.started inbound=%s group=%s", ",".join(inbound.topics), group)
            await processor.run(stop)
        finally:
            await consumer.stop()
    finally:
        if rollup is not None:
            if stop.is_set():  # it ends by itself, after its last rollup
                await asyncio.gather(rollup, return_exceptions=True)
            else:  # the router failed: the rollup goes with it (its records are re-read later)
                await cancel_and_wait(rollup)
        if processor.kv_follower is not None:
            await processor.kv_follower.close()
        await producer.stop()
        await redis.aclose()
        if server is not None:
            await server.close()
        log.info("router.stopped routed=%d dead_lettered=%d", processor.routed, processor.dead_lettered)


async def _start_metrics(settings: RouterSettings, processor: RouterProcessor) -> MetricsServer | None:
    if not settings.router_metrics_port:
        return None
    server = MetricsServer(processor.metrics.registry, settings.router_metrics_port)
    try:
        await server.start()
    except OSError as exc:  # a second router on one host routes, unobserved, rather than not at all
        log.warning("router.metrics_port_unavailable port=%d error=%s", settings.router_metrics_port, exc)
        return None
    return server


def serve_router(settings: RouterSettings | None = None) -> None:
    """Run the router stream processor until SIGINT or SIGTERM (blocking); for the CLI. Without ``settings``, the
    router's own (:class:`RouterSettings`) are read from the environment."""
    own = settings or RouterSettings()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_router(own, stop=stop)

    asyncio.run(main())
    shutdown_tracing()
