"""Redis client setup against a real server: stream appends, blocking reads that see a later append,
reads from an entry id, and the factory's timeouts."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluicegate.redis_client import create_redis, wait_for_redis
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_wait_for_redis_returns_version(redis_url: str) -> None:
    version = await wait_for_redis(redis_url, timeout_s=5)
    assert version[0].isdigit()


async def test_wait_for_redis_times_out_on_closed_port() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not ready"):
        await wait_for_redis("redis://127.0.0.1:1/0", timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_create_redis_rejects_non_positive_socket_timeout() -> None:
    with pytest.raises(ValueError, match="socket_timeout"):
        create_redis(url="redis://127.0.0.1:6379/0", socket_timeout=0)


async def test_xadd_and_read_from_id(redis: Redis, unique_prefix: str) -> None:
    key = f"{unique_prefix}llm:stream:r1"
    for seq in range(1, 4):
        entry_id = await redis.xadd(key, {"seq": str(seq), "text": f"tok{seq}"}, id=f"{seq}-0")
        assert entry_id == f"{seq}-0".encode()  # bytes: the factory does not decode responses

    # A reconnecting reader passes the last id it saw and gets only what follows.
    result = await redis.xread({key: "1-0"})
    [(stream, entries)] = result
    assert stream == key.encode()
    assert [(eid, fields[b"text"]) for eid, fields in entries] == [(b"2-0", b"tok2"), (b"3-0", b"tok3")]


async def test_explicit_ids_make_appends_idempotent(redis: Redis, unique_prefix: str) -> None:
    key = f"{unique_prefix}llm:stream:r2"
    await redis.xadd(key, {"seq": "1"}, id="1-0")
    with pytest.raises(ResponseError, match="equal or smaller"):
        await redis.xadd(key, {"seq": "1"}, id="1-0")
    assert await redis.xlen(key) == 1


async def test_blocking_xread_receives_later_append(redis: Redis, test_settings: Settings, unique_prefix: str) -> None:
    key = f"{unique_prefix}llm:stream:r3"
    await redis.xadd(key, {"seq": "1"}, id="1-0")

    # The blocking read waits on the factory's client (no socket timeout), the append comes from another.
    reader = asyncio.create_task(redis.xread({key: "1-0"}, block=10_000))
    await asyncio.sleep(0.2)
    assert not reader.done()
    writer = create_redis(test_settings)
    try:
        started = time.monotonic()
        await writer.xadd(key, {"seq": "2"}, id="2-0")
        [(_, entries)] = await asyncio.wait_for(reader, timeout=5)
    finally:
        await writer.aclose()
    assert [(eid, fields[b"seq"]) for eid, fields in entries] == [(b"2-0", b"2")]
    assert time.monotonic() - started < 2


async def test_blocking_xread_times_out_empty(redis: Redis, unique_prefix: str) -> None:
    key = f"{unique_prefix}llm:stream:r4"
    await redis.xadd(key, {"seq": "1"}, id="1-0")
    started = time.monotonic()
    assert await redis.xread({key: "1-0"}, block=300) == []
    assert 0.25 < time.monotonic() - started < 3
