"""The usage rollup: reads the ledger (``llm.usage``) in a consumer group and keeps per-tenant hourly aggregates
in Redis, by model and by API key, which ``GET /v1/usage`` reads (:mod:`.report`); it also settles each
request's quota reservation to the tokens its record says it used (:mod:`.quota`).

Counting once: the ledger is at-least-once (see :mod:`.ledger`), so each record is applied by one Lua script
that sets a marker for its request id (``SET NX EX usage_dedup_ttl_s``) and only if that succeeded adds the
record to its hour's hash, all atomically: a duplicate (a record sent again by the worker that took over, a
batch re-read after this consumer died before committing) changes nothing. Settling is idempotent on its own.
Offsets are committed after a batch is applied; a failed batch is re-read after a pause.

Where it runs: a task of the router process (``sluicegate router``, ``SLUICEGATE_USAGE_ROLLUP``), which every
deployment has (``up``, compose, the Helm chart) and which already is a Kafka stream processor with Redis at
hand; routers share the ledger's partitions through the consumer group, as they share ``llm.inbound``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas import Names, UsageRecord
from sluicegate.kafka import create_consumer, ensure_topics, rewind_batch
from sluicegate.settings import UsageRollupSettings

from .quota import Quotas

log = logging.getLogger(__name__)

#: What each record adds to its groups, by field name in the hour's hash (``<group>|<metric>|<value>``).
METRICS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "total_tokens",
    "finished",
    "cancelled",
    "failed",
    "response_cache",
)

# KEYS[1]: the request's marker, KEYS[2]: the hour's hash, KEYS[3]: the tenant's hours index.
# ARGV[1]: marker TTL (s), ARGV[2]: the hour, ARGV[3]: expiry of the aggregates (unix s), ARGV[4]: oldest hour
# kept, ARGV[5]: model, ARGV[6]: key id ('' for none), ARGV[7]: LoRA adapter ('' for none), ARGV[8..]: metric, value
# pairs. Returns 1 when counted.
_APPLY = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 8, #ARGV, 2 do
  local value = tonumber(ARGV[i + 1])
  if value ~= 0 then
    redis.call('HINCRBY', KEYS[2], 'model|' .. ARGV[i] .. '|' .. ARGV[5], value)
    redis.call('HINCRBY', KEYS[2], 'key|' .. ARGV[i] .. '|' .. ARGV[6], value)
    redis.call('HINCRBY', KEYS[2], 'adapter|' .. ARGV[i] .. '|' .. ARGV[7], value)
  end
end
redis.call('EXPIREAT', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4])
redis.call('EXPIREAT', KEYS[3], ARGV[3])
return 1
"""


def record_metrics(record: UsageRecord) -> dict[str, int]:
    """What one record adds: a request, its tokens, one of its outcome and whether the response cache answered."""
    return {
        "requests": 1,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "output_tokens": record.output_tokens,
        "total_tokens": record.total_tokens,
        "finished": int(record.outcome == "finished"),
        "cancelled": int(record.outcome == "cancelled"),
        "failed": int(record.outcome == "failed"),
        "response_cache": int(record.response_cache),
    }


class UsageAggregates:
    """Applies ledger records to Redis: aggregates once per request id, then quota settlement."""

    def __init__(self, redis: Redis, names: Names, *, dedup_ttl_s: int, retention_days: int) -> None:
        self._redis = redis
        self._names = names
        self._dedup_ttl_s = dedup_ttl_s
        self._retention_s = retention_days * 86400
        self._apply = redis.register_script(_APPLY)
        self.quotas = Quotas(redis, names)

    async def apply(self, records: Iterable[UsageRecord]) -> int:
        """Count each record not counted before and settle its request's quota; returns how many were new.
        Raises ``RedisError``/``OSError`` when Redis does not answer (then nothing or part was applied, and
        applying the same records again finishes the job without counting any twice)."""
        records = list(records)
        if not records:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for record in records:
            finished = int(record.finished_at.timestamp())
            hour = finished // 3600
            keys = [
                self._names.usage_seen_key(record.request_id),
                self._names.usage_bucket_key(record.tenant, hour),
                self._names.usage_hours_key(record.tenant),
            ]
            args: list[str | int] = [
                self._dedup_ttl_s,
                hour,
                finished + self._retention_s,
                (finished - self._retention_s) // 3600,
                record.model,
                record.key_id or "",
                record.adapter or "",
            ]
            for metric, value in record_metrics(record).items():
                args += [metric, value]
            await self._apply(keys=keys, args=args, client=pipe)
        counted = sum(int(v) for v in await pipe.execute())
        await self.quotas.settle_many((r.request_id, r.total_tokens) for r in records)
        return counted


class UsageRollup:
    """The ledger's consumer: batch by batch, parse, apply, commit."""

    def __init__(
        self, consumer: AIOKafkaConsumer, aggregates: UsageAggregates, *, retry_backoff_s: float = 1.0
    ) -> None:
        self.consumer = consumer
        self.aggregates = aggregates
        self.retry_backoff_s = retry_backoff_s
        self.counted = 0
        self.duplicates = 0
        self.malformed = 0

    def _parse(self, records: Iterable[ConsumerRecord]) -> list[UsageRecord]:
        parsed = []
        for record in records:
            try:
                parsed.append(UsageRecord.model_validate_json(record.value or b""))
            except ValidationError as exc:
                self.malformed += 1
                log.error("usage.malformed_record partition=%s offset=%s: %s", record.partition, record.offset, exc)
        return parsed

    async def process(self, batch: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Apply one fetched batch, then commit past it."""
        records = self._parse(r for rs in batch.values() for r in rs)
        counted = await self.aggregates.apply(records)
        self.counted += counted
        self.duplicates += len(records) - counted
        offsets = {tp: rs[-1].offset + 1 for tp, rs in batch.items() if rs}
        if offsets:
            await self.consumer.commit(offsets)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set; a batch that fails (Redis or Kafka) is re-read from its first offset after a pause."""
        while not stop.is_set():
            batch = await self.consumer.getmany(timeout_ms=500, max_records=500)
            if not batch:
                continue
            try:
                await self.process(batch)
            except (RedisError, OSError, KafkaError, TimeoutError) as exc:
                log.error("usage.batch_failed records=%d error=%r; retrying", sum(map(len, batch.values())), exc)
                rewind_batch(self.consumer, batch)
                try:
                    await asyncio.wait_for(stop.wait(), self.retry_backoff_s)
                except TimeoutError:
                    pass


async def keep_rolling_up(
    settings: UsageRollupSettings, redis: Redis, stop: asyncio.Event, *, backoff_s: float = 2.0
) -> None:
    """:func:`run_usage_rollup` until ``stop`` is set, started again after anything that ends it early (Kafka not
    up yet at start, a lost group...), so the process it runs in never goes on without it."""
    while not stop.is_set():
        try:
            await run_usage_rollup(settings, redis, stop)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("usage.rollup_failed; restarting in %.0f s", backoff_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff_s)


async def run_usage_rollup(settings: UsageRollupSettings, redis: Redis, stop: asyncio.Event) -> UsageRollup:
    """Create ``llm.usage`` if missing, join group ``<prefix><usage_group>`` (from the earliest record: nothing
    written before the first rollup started is missed) and roll up until ``stop`` is set."""
    names = settings.names
    await ensure_topics(
        settings.kafka_bootstrap,
        {names.usage_topic: settings.topic_partitions},
        settings.topic_replication,
        settings=settings,
    )
    group = f"{names.prefix}{settings.usage_group}"
    consumer = create_consumer(
        names.usage_topic, group_id=group, settings=settings, client_id="sluicegate-usage-rollup"
    )
    aggregates = UsageAggregates(
        redis, names, dedup_ttl_s=settings.usage_dedup_ttl_s, retention_days=settings.usage_retention_days
    )
    rollup = UsageRollup(consumer, aggregates)
    await consumer.start()
    try:
        log.info("usage.rollup_started topic=%s group=%s", names.usage_topic, group)
        await rollup.run(stop)
    finally:
        await consumer.stop()
        log.info("usage.rollup_stopped counted=%d duplicates=%d", rollup.counted, rollup.duplicates)
    return rollup
