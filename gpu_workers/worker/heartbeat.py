"""The worker's heartbeat: what it reports (partitions, engine load, draining, the LoRA adapters it holds), sent
every interval to the Redis hash that ingress and the router read and to ``llm.heartbeats``, and removed on
shutdown. The first successful beat also publishes the model's tokenizer (``model_tokenizer``), with which
ingress counts prompts."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from gpu_workers.engine import EngineFront
from schemas import ModelTokenizer, Names, PartitionRef, WorkerHeartbeat

from .adapters import Adapters
from .config import WorkerConfig
from .kv_events import KVEventPublisher
from .prompts import reasoning_parser, tool_call_format
from .streams import REDIS_UNAVAILABLE
from .telemetry import WorkerTelemetry

log = logging.getLogger(__name__)


class Heartbeats:
    """Beats while the worker runs; a dead engine ends the loop (and with it the worker)."""

    def __init__(
        self,
        engine: EngineFront,
        config: WorkerConfig,
        names: Names,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        stopping: asyncio.Event,
        adapters: Adapters | None = None,
    ) -> None:
        self.adapters = adapters
        self.engine = engine
        self.config = config
        self.names = names
        self.redis = redis
        self.producer = producer
        self.consumer = consumer  # the group consumer, for the partitions this worker owns
        self.stopping = stopping
        # monotonic time of the last successful Redis write (readiness), and the metrics to tell.
        self.last_written: float | None = None
        self.telemetry: WorkerTelemetry | None = None  # set by the Worker
        self._tool_call_format = tool_call_format(engine.tokenizer)
        self._reasoning_parser = reasoning_parser(engine.tokenizer, config.reasoning_parser)
        self._tokenizer_json: str | None = None  # "published" once the tokenizer is in Redis
        self.kv_events: KVEventPublisher | None = None  # set by the Worker when it publishes KV events

    def beat(self) -> WorkerHeartbeat:
        stats = self.engine.stats()
        return WorkerHeartbeat(
            worker_id=self.config.worker_id,
            model=self.config.model_name,
            partitions=[PartitionRef(topic=tp.topic, partition=tp.partition) for tp in self.consumer.assignment()],
            running=stats.num_running,
            waiting=stats.num_waiting,
            free_kv_blocks=stats.num_free_blocks,
            total_kv_blocks=stats.num_total_blocks,
            prefix_cache_hit_rate=min(1.0, max(0.0, stats.prefix_cache_hit_rate)),
            device=self.config.device,
            deterministic=self.config.deterministic,
            arithmetic=self.engine.arithmetic,
            draining=self.stopping.is_set(),
            max_model_len=self.engine.max_model_len,
            tool_call_format=self._tool_call_format,
            reasoning_parser=self._reasoning_parser,
            architecture=self.engine.architecture or None,
            description=self.config.model_description or None,
            backlog_seconds=self.telemetry.backlog_seconds if self.telemetry is not None else None,
            adapters=self.adapters.names() if self.adapters is not None else [],
            lora=self.adapters is not None,
            kv_events_seq=self.kv_events.last_seq if self.kv_events is not None else None,
        )

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            if not self.engine.is_running:
                # An engine that died while idle: stop advertising this worker and let another take its partitions.
                raise RuntimeError("the engine stopped; stopping this worker")
            if self.adapters is not None:
                await self.adapters.refresh()
            payload = self.beat().model_dump_json()
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(self.names.workers_key(self.config.model_name), self.config.worker_id, payload)
                pipe.sadd(self.names.models_key, self.config.model_name)
                if self._tokenizer_json is None:
                    published = model_tokenizer(
                        self.config.model_name, self.engine.tokenizer, self.engine.max_model_len
                    )
                    if published is not None:
                        pipe.set(self.names.tokenizer_key(self.config.model_name), published)
                await pipe.execute()
                self._tokenizer_json = self._tokenizer_json or "published"
                self.last_written = time.monotonic()
                if self.telemetry is not None:
                    self.telemetry.heartbeat_written()
            except (*REDIS_UNAVAILABLE, RedisError) as exc:
                # Skipped, not fatal: the next beat goes out once Redis is back. Any Redis error: a refusal such as
                # NOREPLICAS (a primary told to write only with replicas, one of them down) is as passing as an
                # outage, and a worker that died of it would give up its requests for nothing.
                log.warning("worker.heartbeat_redis_failed", extra={"error": str(exc)})
            # Not awaited: a slow Kafka acknowledgement must not delay the next beat that routing reads.
            try:
                sent = await self.producer.send(
                    self.names.heartbeats_topic, payload.encode(), key=self.config.worker_id.encode()
                )
                sent.add_done_callback(_log_send_failure)
            except KafkaError as exc:
                log.warning("worker.heartbeat_kafka_failed", extra={"error": repr(exc)})
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.config.heartbeat_interval_s - elapsed))

    async def remove(self) -> None:
        """Stop advertising this worker (best effort)."""
        with contextlib.suppress(Exception):
            await self.redis.hdel(self.names.workers_key(self.config.model_name), self.config.worker_id)


def model_tokenizer(model: str, tokenizer: Any, max_model_len: int | None) -> str | None:
    """The ``ModelTokenizer`` JSON for a fast (``tokenizers``-backed) tokenizer; None for another kind (then
    ingress cannot count exactly and leaves the check to the worker)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    tokenizer_json = backend.to_str()
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    digest = hashlib.sha256(f"{tokenizer_json}\0{template or ''}".encode()).hexdigest()
    return ModelTokenizer(
        model=model,
        digest=digest,
        tokenizer_json=tokenizer_json,
        chat_template=template,
        bos_token=getattr(tokenizer, "bos_token", None),
        eos_token=getattr(tokenizer, "eos_token", None),
        max_model_len=max_model_len,
    ).model_dump_json()


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("worker.heartbeat_kafka_failed", extra={"error": repr(future.exception())})
