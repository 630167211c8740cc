"""Fixtures shared by the integration tests: a Redis client and Kafka topic cleanup, both scoped to the
test's own prefix so nothing a test leaves behind reaches another."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from ingress_support import delete_prefixed_keys, delete_prefixed_topics
from redis.asyncio import Redis

from sluicegate.redis_client import create_redis


@pytest.fixture
async def redis(redis_url: str, unique_prefix: str) -> AsyncIterator[Redis]:
    """A client from the project's factory; deletes this test's keys afterwards."""
    client = create_redis(url=redis_url)
    yield client
    await delete_prefixed_keys(client, unique_prefix)
    await client.aclose()


@pytest.fixture
async def cleanup_topics(kafka_bootstrap: str, unique_prefix: str) -> AsyncIterator[None]:
    """Deletes every topic this test created (they all carry its prefix)."""
    yield
    await delete_prefixed_topics(kafka_bootstrap, unique_prefix)
