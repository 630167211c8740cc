"""``StreamPublisher(replica_ack=True)`` against real Redis servers: flushed events are kept until a replica
acknowledges them, a failed flush re-appends them before anything new, and the number kept is bounded.

The failover itself (Sentinels promoting a replica that missed appends) is in ``test_faults_redis_sentinel.py``;
here a dropped connection plus a stream that lost its tail stand in for it, on the shared test Redis.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import pytest
from needs import needs
from redis.asyncio import Redis

from benchmarks.redis_failover import redis_pair
from gpu_workers.worker.streams import StreamPublisher
from schemas import STREAM_FIELD, Names, TokenEvent, parse_stream_event, stream_entry_id
from sluicegate.redis_client import create_redis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def token(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, seq=seq, text=f" t{seq}", token_ids=[seq])


async def stream_seqs(redis: Redis, names: Names, request_id: str) -> list[int]:
    entries = await redis.xrange(names.stream_key(request_id))
    return [parse_stream_event(fields[STREAM_FIELD.encode()]).seq for _, fields in entries]


async def lose_tail_and_drop_connection(replica_ack: bool, redis_url: str, redis: Redis, names: Names) -> list[int]:
    """Flush seq 0..4; the server then holds only 0..1 (what a promoted replica had) and the publisher's
    connection is dropped; flush seq 5. Returns the stream's seqs afterwards."""
    name = f"pub-{uuid.uuid4().hex[:8]}"
    client = create_redis(url=redis_url, socket_timeout=5, retries=0, client_name=name)
    publisher = StreamPublisher(client, names, ttl_s=60, replica_ack=replica_ack)
    request_id = uuid.uuid4().hex
    try:
        for seq in range(5):
            publisher.add(token(request_id, seq))
        await publisher.flush()
        assert publisher.unconfirmed == (5 if replica_ack else 0)  # the shared Redis has no replica
        key = names.stream_key(request_id)
        await redis.delete(key)
        for seq in range(2):
            await redis.xadd(key, {STREAM_FIELD: token(request_id, seq).model_dump_json()}, id=stream_entry_id(seq))
        assert await stream_seqs(redis, names, request_id) == [0, 1]
        # The connection drops while the flush waits on it: writes are paused, so the flush's pipeline sits on the
        # server unexecuted when its connection is killed. (A connection killed while idle is replaced by the pool
        # before the next command, unseen: only a drop under a command is a failed flush.)
        await redis.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
        try:
            publisher.add(token(request_id, 5))
            flush = asyncio.create_task(publisher.flush())
            killed: list[str] = []
            deadline = time.monotonic() + 5
            while not killed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                # The flush's pipeline is on the server once its client waits in a paused write.
                killed = [
                    entry["id"]
                    for entry in await redis.client_list()
                    if entry.get("name") == name and "b" in entry.get("flags", "")
                ]
            assert len(killed) == 1, "the flush never reached the paused server"
            await redis.execute_command("CLIENT", "KILL", "ID", killed[0])
        finally:
            await redis.execute_command("CLIENT", "UNPAUSE")
        await asyncio.wait_for(flush, 10)
        assert publisher.retries >= 1
        return await stream_seqs(redis, names, request_id)
    finally:
        await client.aclose()


async def test_a_failed_flush_re_appends_what_no_replica_acknowledged(
    redis_url: str, redis: Redis, unique_prefix: str
) -> None:
    names = Names(unique_prefix)
    assert await lose_tail_and_drop_connection(True, redis_url, redis, names) == [0, 1, 2, 3, 4, 5]
    # Without it the lost tail stays lost: the stream continues after a gap.
    assert await lose_tail_and_drop_connection(False, redis_url, redis, names) == [0, 1, 5]


async def test_a_connection_dropped_while_idle_re_appends_what_no_replica_acknowledged(
    redis_url: str, redis: Redis, unique_prefix: str
) -> None:
    # redis-py replaces a connection killed while idle before the next command, without an error: the publisher
    # learns of the new connection from its client's connect hook and re-appends the kept events first.
    names = Names(unique_prefix)
    name = f"idle-{uuid.uuid4().hex[:8]}"
    client = create_redis(url=redis_url, socket_timeout=5, retries=0, client_name=name)
    publisher = StreamPublisher(client, names, ttl_s=60, replica_ack=True)
    request_id = uuid.uuid4().hex
    key = names.stream_key(request_id)
    try:
        for seq in range(5):
            publisher.add(token(request_id, seq))
        await publisher.flush()
        await redis.delete(key)
        for seq in range(2):
            await redis.xadd(key, {STREAM_FIELD: token(request_id, seq).model_dump_json()}, id=stream_entry_id(seq))
        (victim,) = [entry["id"] for entry in await redis.client_list() if entry.get("name") == name]
        await redis.execute_command("CLIENT", "KILL", "ID", victim)
        publisher.add(token(request_id, 5))
        await publisher.flush()
        assert publisher.reappended == 5
        assert await stream_seqs(redis, names, request_id) == [0, 1, 2, 3, 4, 5]
    finally:
        await redis.delete(key)
        await client.aclose()


async def test_events_kept_for_a_replica_are_bounded(redis_url: str, unique_prefix: str) -> None:
    client = create_redis(url=redis_url, socket_timeout=5, retries=0)
    publisher = StreamPublisher(client, Names(unique_prefix), ttl_s=60, replica_ack=True, max_unconfirmed=3)
    request_id = uuid.uuid4().hex
    try:
        for seq in range(5):
            publisher.add(token(request_id, seq))
            await publisher.flush()
        assert (publisher.unconfirmed, publisher.unconfirmed_dropped) == (3, 2)
    finally:
        await client.aclose()


@needs(shutil.which("redis-server") is not None, "redis-server", "apt-get install redis-server")
async def test_a_replica_acknowledgement_releases_kept_events() -> None:
    with redis_pair() as pair:
        await pair.synced()
        client = create_redis(url=pair.node_url("primary"), socket_timeout=5, retries=0)
        publisher = StreamPublisher(client, Names("ack"), ttl_s=60, replica_ack=True)
        try:
            for seq in range(3):
                publisher.add(token("r1", seq))
            await publisher.flush()
            assert publisher.unconfirmed == 3
            # A replica reports its offset about once a second; an idle flush asks for it (the worker's flush
            # loop does this every 0.5 s while events are kept).
            deadline = time.monotonic() + 5
            while publisher.unconfirmed:
                assert time.monotonic() < deadline, "the replica's acknowledgement never released the events"
                await asyncio.sleep(0.2)
                await publisher.flush()
            replica = create_redis(url=pair.node_url("replica"), socket_timeout=5)
            try:
                assert await stream_seqs(replica, Names("ack"), "r1") == [0, 1, 2]
            finally:
                await replica.aclose()
        finally:
            await client.aclose()
