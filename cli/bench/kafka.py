"""``sluicegate bench --target kafka``: the Kafka-native path, as a producer outside the HTTP API uses it.

Each prompt becomes an :class:`~schemas.InferenceRequest` produced (acknowledged, keyed by its request id) to
``llm.inbound``, the topic the router validates and routes; the request's Redis stream (``llm:stream:<id>``) is
then read with ``XREAD BLOCK`` until its ``done`` or ``error`` event, as the result service reads it. TTFT is
from the produce call to the first token entry read; ITL the gaps between token entries read; token counts are
the ``done`` event's usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from typing import Any

from cli.bench.measure import BenchError, Prompt, Sample, unreachable
from sluicegate.redis_urls import mask_url
from sluicegate.settings import get_settings


class KafkaTarget:
    """Produces requests to ``llm.inbound`` and follows each one's Redis stream."""

    def __init__(self, args: argparse.Namespace) -> None:
        settings = get_settings()
        self.args = args
        self.bootstrap = args.kafka_bootstrap or settings.kafka_bootstrap
        self.redis_url = args.redis_url or settings.redis_url
        from schemas import Names

        self.names = Names(settings.topic_prefix if args.topic_prefix is None else args.topic_prefix)
        self.model: str = args.model or settings.model_name
        self.producer: Any = None
        self.redis: Any = None

    async def start(self) -> None:
        """Connect to Redis and Kafka, and check a worker serves the model (its heartbeats are in Redis)."""
        from aiokafka.errors import KafkaError
        from redis.exceptions import RedisError

        from sluicegate.kafka import create_producer
        from sluicegate.redis_client import create_redis

        if not self.model:
            raise BenchError("--target kafka needs --model (or SLUICEGATE_MODEL_NAME)")
        self.redis = create_redis(url=self.redis_url, client_name="sluicegate-bench", retries=1)
        try:
            workers = await self.redis.hlen(self.names.workers_key(self.model))
        except (RedisError, OSError) as exc:
            raise unreachable(f"Redis at {mask_url(self.redis_url)}", exc) from exc
        if not workers:
            raise BenchError(
                f"unknown model {self.model!r}: no worker heartbeats at {self.names.workers_key(self.model)}"
            )
        self.producer = create_producer(
            bootstrap=self.bootstrap, client_id="sluicegate-bench", request_timeout_ms=10_000
        )
        try:
            await asyncio.wait_for(self.producer.start(), 20)
        except (KafkaError, OSError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await self.producer.stop()  # a half-started producer is closed, not left to the interpreter's exit
            self.producer = None
            raise unreachable(f"Kafka at {self.bootstrap}", exc) from exc

    async def close(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        if self.redis is not None:
            await self.redis.aclose()

    async def send(self, prompt: Prompt, sample: Sample) -> None:
        from schemas import STREAM_FIELD, ChatMessage, InferenceRequest, SamplingOptions, parse_stream_event

        args = self.args
        request_id = f"bench-{uuid.uuid4().hex[:16]}"
        sampling = SamplingOptions(
            temperature=args.temperature, max_tokens=prompt.max_tokens, ignore_eos=args.ignore_eos
        )
        text = {"messages": [ChatMessage(role="user", content=prompt.text)]} if args.endpoint == "chat" else {}
        request = InferenceRequest(
            request_id=request_id,
            model=self.model,
            prompt=None if text else prompt.text,
            sampling=sampling,
            priority=args.priority,
            tenant="bench",
            **text,
        )
        await self.producer.send_and_wait(
            self.names.inbound_topic, request.model_dump_json().encode(), key=request_id.encode()
        )
        key, last_id = self.names.stream_key(request_id, request.tenant), "0-0"
        deadline = sample.sent + args.timeout
        while time.monotonic() < deadline:
            replies = await self.redis.xread({key: last_id}, block=1000, count=256)
            now = time.monotonic()
            for _, entries in replies or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    event = parse_stream_event(fields[STREAM_FIELD.encode()])
                    if event.type == "token":
                        sample.content_at(now)
                    elif event.type == "done":
                        sample.ended(now)
                        sample.prompt_tokens = event.usage.prompt_tokens
                        sample.output_tokens = event.usage.completion_tokens
                        return
                    elif event.type == "error":
                        sample.error = f"{event.code}: {event.message}"[:200]
                        return
        sample.error = f"no done event within {args.timeout:g} s (dead-lettered? see sluicegate dlq list)"
