"""What ingress does against Kafka and Redis: decide whether a model is served, route a request and record +
publish it as one step (the Kafka record acknowledged by every in-sync replica, the status record written while
it is), cancel (through the one cancel path, ``sluicegate.cancellation``), read status, and follow a request's
Redis stream (through the one stream follower, ``sluicegate.stream_follower``). Whether a request may be
published at all (limits, quotas, deadline, backlog) is admission's, in :mod:`ingress.accept`.

Every Kafka wait is bounded by ``kafka_timeout_s`` and surfaces as a 503, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from router.heartbeats import HeartbeatCache
from router.kv_follower import KVFollower
from router.kv_index import KVIndex
from router.publish import TopicRegistry, request_headers, send_routed
from router.router import Route, Router
from schemas import InferenceRequest, RequestRecord, StreamEvent, Tier, WorkerHeartbeat
from sluicegate.api.errors import ApiError
from sluicegate.api.prompt_tokens import ModelTokenizers
from sluicegate.cancellation import Canceller
from sluicegate.lora.registry import LoRARegistry
from sluicegate.lora.resolve import AdapterResolver
from sluicegate.redis_client import create_redis
from sluicegate.settings import IngressSettings
from sluicegate.stream_entries import StreamEntry, parse_entry
from sluicegate.stream_follower import FollowerConfig, StreamFollower
from sluicegate.stream_subscription import START_SEQ, SlowConsumer
from sluicegate.telemetry import untraced
from sluicegate.usage.quota import Quotas

from .backlog import BacklogMonitor
from .errors import unavailable
from .model_routes import ModelRoutes
from .producer_pool import ProducerPool
from .ratelimit import RateLimiter
from .reader_lease import ReaderLease
from .response_cache import ResponseCache
from .telemetry import IngressMetrics
from .usage_ledger import UsageLedger

log = logging.getLogger(__name__)

# Turns the status-record task yields before its write. Its first step runs the turn after producer.send(), as
# the accumulator's waiter wakes aiokafka's sender; the sender's step starts the produce task the turn after,
# and that task writes the produce request the turn after that. Yielding twice puts the record right behind it.
_SENDER_TURNS = 2


class IngressService:
    """The state one ingress process shares across requests."""

    def __init__(self, settings: IngressSettings, metrics: IngressMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.names = settings.names
        # Every command bounded, once: a Redis that hangs is a 503 within ingress_redis_timeout_s, not a request that
        # waits as long as it hangs. The stream follower's blocked XREADs bound their own reads (block_ms + grace).
        self.redis: Redis = create_redis(
            settings,
            socket_timeout=settings.ingress_redis_timeout_s,
            connect_timeout=2.0,
            client_name="ingress",
            retry_timeouts=False,
        )
        # What the workers' KV caches hold (from their events), for routing on the cached prefix.
        self.kv_index = KVIndex(settings.router_kv_index_max_blocks) if settings.kv_events else None
        self.kv_follower = KVFollower(settings, self.kv_index, service="ingress") if self.kv_index else None
        self.router = Router.from_settings(settings, self.kv_index, metrics.registry)
        self.topics = TopicRegistry(
            settings,
            self.names,
            self.router,
            partitions=settings.topic_partitions,
            replication=settings.topic_replication,
            timeout_s=settings.kafka_timeout_s,
        )
        self.heartbeats = HeartbeatCache(self.redis, self.names, max_age_s=3 * settings.heartbeat_interval_s)
        self.tokenizers = ModelTokenizers(self.redis, self.names)  # the workers' tokenizers: exact prompt counts
        self.producers = ProducerPool(settings)
        # This instance's reader lease: requests it relays to a client that cannot resume them name it.
        self.reader = ReaderLease(self.redis, self.names, settings.reader_lease_s)
        self.backlog = BacklogMonitor(settings, self.names, metrics)
        self.rate_limiter = RateLimiter(self.redis, self.names)
        self.quotas = Quotas(self.redis, self.names)
        self.usage = UsageLedger(self.names, self._usage_producer, timeout_s=settings.kafka_timeout_s)
        self._usage_ready = False
        self.served_models = settings.served_model_names
        # LoRA adapters as model names: the registry (load/unload) and its cached view every request resolves by.
        self.lora_registry = LoRARegistry(self.redis, settings.topic_prefix)
        self.adapters = AdapterResolver(self.lora_registry, ttl_s=settings.lora_cache_ttl_s)
        self._control_ready = False
        self.canceller = Canceller(
            self.redis,
            self.names,
            marker_ttl_s=settings.request_record_ttl_s,
            lease=self._control_producer,
            publish_timeout_s=settings.kafka_timeout_s,
            service="ingress",
        )
        # One shared reader for every request's stream (started on first use, on the serving loop); a
        # new stream wakes it with CLIENT UNBLOCK, so a request starts being followed at once.
        self.follower: StreamFollower[StreamEntry] = StreamFollower(
            self.redis, self.names, FollowerConfig(), decode=parse_entry
        )
        self.cache = ResponseCache(self.redis, self.names, settings, metrics, follow=self.events)
        self.routes = ModelRoutes(settings, metrics, follow=self.events, redis=self.redis, names=self.names)

    async def close(self) -> None:
        """Release Kafka and Redis connections."""
        try:
            if self.kv_follower is not None:
                await self.kv_follower.close()
            await self.reader.close()
            await self.cache.close()
            await self.usage.close()
            await self.routes.close()
            await self.follower.close()
            await self.backlog.close()
            await self.producers.close()
        finally:
            await self.redis.aclose()

    # --- models ---------------------------------------------------------------------------------
    async def live_models(self) -> dict[str, list[WorkerHeartbeat]]:
        """Models with a live worker, with their heartbeats."""
        try:
            return await self.heartbeats.live_models()
        except (RedisError, OSError) as exc:
            raise unavailable("Redis", exc) from exc

    async def model_heartbeats(self, model: str) -> list[WorkerHeartbeat]:
        """The model's live heartbeats; 404 when it has none and is not configured as served."""
        try:
            beats = await self.heartbeats.get(model)
        except (RedisError, OSError) as exc:
            raise unavailable("Redis", exc) from exc
        if not beats and model not in self.served_models:
            raise ApiError(
                404,
                f"The model '{model}' does not exist or has no live worker.",
                code="model_not_found",
                param="model",
            )
        return beats

    # --- publishing -----------------------------------------------------------------------------
    async def route(
        self,
        request: InferenceRequest,
        *,
        max_tier: Tier,
        heartbeats: list[WorkerHeartbeat],
        prompt_ids: list[int] | None = None,
        lora_int_id: int | None = None,
    ) -> Route:
        """Where ``request`` goes: its tier's topic (capped at ``max_tier``) and a partition, from the model's live
        ``heartbeats``. The producers are started and the model's topics made on first use: a Kafka that does not
        answer is a 503 here, before admission charges anything."""
        try:
            await self.producers.start()
            await self.topics.ensure_model(request.model)
        except (KafkaError, TimeoutError, OSError) as exc:
            self.metrics.publish_failures.labels(request.model).inc()
            raise unavailable("Kafka", exc) from exc
        self.router.set_heartbeats(request.model, heartbeats)
        return self.router.route(request, max_tier=max_tier, prompt_ids=prompt_ids, lora_int_id=lora_int_id)

    def partitions(self, model: str) -> dict[str, int]:
        """The partition count of each of ``model``'s request topics (what its backlog is read from)."""
        return {topic: self.router.partitions(topic) for topic in self.names.request_topics(model)}

    async def publish(
        self, request: InferenceRequest, route: Route, trace_carrier: Mapping[str, str]
    ) -> RecordMetadata:
        """Record ``request`` as queued and publish it on ``route``, as one step: both happen or neither stays.
        Returns where Kafka put it. Admission (``ingress.accept``) has checked and charged it already.

        The status record is written while the broker acknowledges the produce, so it costs no round trip of its
        own. 503 when Kafka or Redis fails: a publish that failed leaves no record (and gives back the request's
        quota reservation), and a request in Kafka whose record failed is cancelled (workers never start it).
        """
        record = RequestRecord(
            request_id=request.request_id,
            model=request.model,
            tenant=request.tenant,
            priority=route.tier,
            status="queued",
            created_at=request.created_at,
            trace=request.trace,
        )
        started = time.perf_counter()
        saving: asyncio.Task[None] | None = None
        published: RecordMetadata | KafkaError | TimeoutError | OSError
        try:
            async with asyncio.timeout(self.settings.kafka_timeout_s):
                with self.producers.lease() as producer:
                    delivery = await send_routed(producer, request, route, request_headers(request, trace_carrier))
                    # The status record is written while the broker acknowledges, so it costs the request path no
                    # round trip of its own; and only once the produce request is on the wire (see _save_record),
                    # because the produce is what the first token waits for.
                    saving = asyncio.create_task(self._save_record(record))
                    published = await delivery
        except (KafkaError, TimeoutError, OSError) as exc:
            published = exc
        except BaseException:
            if saving is not None:
                saving.cancel()
            raise
        if not isinstance(published, RecordMetadata):
            self.metrics.publish_failures.labels(request.model).inc()
            if saving is not None:
                # Let the record land before _abandon deletes it, or it would outlive the refused request.
                with contextlib.suppress(RedisError, OSError):
                    await saving
            await self._abandon(request)
            raise unavailable("Kafka", published, request_id=request.request_id) from published
        assert saving is not None  # a delivery was awaited, so the record was started
        try:
            await saving
        except (RedisError, OSError) as exc:
            # The request is in Kafka but its client hears 503: take it back over the control topic (workers
            # drop a request cancelled before they start it), so a retry does not run it twice.
            await self.canceller.publish(request.request_id, request.tenant, "record_failed")
            raise unavailable("Redis", exc, request_id=request.request_id) from exc
        self.metrics.publish_latency.observe(time.perf_counter() - started)
        self.metrics.published.labels(request.model, route.tier, route.reason).inc()
        log.info(
            "ingress.published request_id=%s model=%s topic=%s partition=%s reason=%s tenant=%s",
            request.request_id,
            request.model,
            route.topic,
            route.partition,
            route.reason,
            request.tenant,
        )
        return published

    async def _save_record(self, record: RequestRecord) -> None:
        """Write the "queued" status record, a few event-loop turns from now.

        Started right after ``producer.send()``: a Redis write made before aiokafka's sender has written the
        produce request would hold that request back (see ``_SENDER_TURNS``). NX: a fast worker's "running"
        (a plain SET) is never overwritten by "queued".
        """
        for _ in range(_SENDER_TURNS):
            await asyncio.sleep(0)
        # No span: a plain write the trace learns nothing from, and a tenth of tracing's CPU in ingress.
        with untraced():
            await self.redis.set(
                self.names.request_key(record.request_id, record.tenant),
                record.model_dump_json(),
                ex=self.settings.request_record_ttl_s,
                nx=True,
            )

    async def _abandon(self, request: InferenceRequest) -> None:
        # A send that timed out may still reach Kafka from the producer's buffer: the cancel marker makes
        # workers drop it, and the record goes because the client was told it failed. Its quota reservation is
        # given back: the request does not run (a worker that still meets it aborts it before it starts).
        with contextlib.suppress(RedisError, OSError):
            await self.quotas.release(request.request_id)
        with contextlib.suppress(RedisError, OSError):
            drop = [self.names.request_key(request.request_id, request.tenant)]
            await self.canceller.mark(request.request_id, request.tenant, "publish_failed", drop=drop)

    # --- status and cancellation ----------------------------------------------------------------
    async def record(self, request_id: str, tenant: str) -> RequestRecord | None:
        """The status record of ``tenant``'s request, or None when unknown or expired."""
        try:
            raw = await self.redis.get(self.names.request_key(request_id, tenant))
        except (RedisError, OSError) as exc:
            raise unavailable("Redis", exc) from exc
        if raw is None:
            return None
        try:
            return RequestRecord.model_validate_json(raw)
        except ValidationError:
            log.error("ingress.bad_record request_id=%s", request_id)
            return None

    async def cancel(self, request_id: str, tenant: str, *, reason: str) -> None:
        """Mark the request cancelled in Redis (honoured even while it waits in Kafka) and tell workers
        over the control topic (the owner aborts it and frees its KV blocks); 503 without Redis."""
        try:
            await self.canceller.cancel(request_id, tenant, reason)
        except (RedisError, OSError) as exc:
            raise unavailable("Redis", exc) from exc
        self.metrics.cancellations.labels(reason).inc()

    @contextlib.asynccontextmanager
    async def _control_producer(self) -> AsyncIterator[AIOKafkaProducer]:
        """A leased ingress producer for the control topic (created, one partition, on first use)."""
        await self.producers.start()
        if not self._control_ready:
            await self.topics.ensure({self.names.control_topic: 1})
            self._control_ready = True
        with self.producers.lease() as producer:
            yield producer

    @contextlib.asynccontextmanager
    async def _usage_producer(self) -> AsyncIterator[AIOKafkaProducer]:
        """A leased ingress producer for the usage ledger (``llm.usage`` created on first use)."""
        await self.producers.start()
        if not self._usage_ready:
            await self.topics.ensure({self.names.usage_topic: self.settings.topic_partitions})
            self._usage_ready = True
        with self.producers.lease() as producer:
            yield producer

    # --- results --------------------------------------------------------------------------------
    async def events(self, request_id: str, tenant: str, *, timeout_s: float) -> AsyncIterator[StreamEvent]:
        """The request's stream events from the first, following the live tail until a terminal event (as
        :meth:`event_batches`, one by one)."""
        async for batch in self.event_batches(request_id, tenant, timeout_s=timeout_s):
            for event in batch:
                yield event

    async def event_batches(
        self, request_id: str, tenant: str, *, timeout_s: float
    ) -> AsyncIterator[list[StreamEvent]]:
        """The request's stream events from the first, following the live tail until a terminal event, as the
        reads deliver them (never an empty batch).

        Raises ``TimeoutError`` when the stream has not ended within ``timeout_s`` overall, and the 503
        ``ApiError`` when Redis fails. Malformed entries are logged and skipped.
        """
        deadline = time.monotonic() + timeout_s
        if not self.follower.started:
            await self.follower.start()
        after = START_SEQ
        while True:
            try:
                async with self.follower.subscribe(request_id, after, tenant=tenant, fail_fast=True) as sub:
                    while not sub.finished:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError(f"no result for request {request_id} within {timeout_s:.0f}s")
                        batch = await sub.next_batch(max_wait_s=remaining)
                        if batch:
                            yield [entry.event for entry in batch]
                    return
            except SlowConsumer:
                # Our reader (the HTTP client) fell behind the buffer: resume after what it has, from Redis.
                after = sub.last_seq
            except (RedisError, OSError) as exc:
                raise unavailable("Redis", exc) from exc
