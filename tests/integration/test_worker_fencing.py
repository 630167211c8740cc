"""Fencing against real Redis and Kafka: a pick-up raises the request's owner epoch, and the fenced-write script
refuses every write of an older owner (appends, records, events re-appended after a new connection); a worker
whose request another owner took over stops it at once, frees its KV blocks and says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import pytest
from private_redis import private_redis
from redis.asyncio import Redis
from test_worker import (  # noqa: F401  (module fixtures: paced_model_dir)
    MODEL,
    paced_model_dir,
    publish,
    read_events,
    request_for,
    running_worker,
    wait_heartbeat_after,
    wait_idle_heartbeat,
)

from gpu_workers.worker.fencing import EPOCH_FIELD, WRITER_FIELD
from gpu_workers.worker.stream_state import read_pickup_state
from gpu_workers.worker.streams import RecordWrite, StreamPublisher
from schemas import DoneEvent, Names, RequestRecord, TokenEvent, Usage
from sluicegate.redis_client import create_redis
from sluicegate.stream_entries import parse_entry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def token(request_id: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=request_id, seq=seq, text=f" t{seq}", token_ids=[seq])


async def writers(redis: Redis, names: Names, request_id: str) -> list[tuple[int, int, str]]:
    """(seq, epoch, writer) of every entry of the request's stream, each entry valid for the stream's readers."""
    key = names.stream_key(request_id)
    out = []
    for entry_id, fields in await redis.xrange(key):
        entry = parse_entry(key, entry_id, fields)
        assert entry is not None, fields
        out.append((entry.seq, int(fields[EPOCH_FIELD.encode()]), fields[WRITER_FIELD.encode()].decode()))
    return out


async def test_a_stale_owner_is_refused_and_only_the_new_owners_writes_follow(
    redis_url: str, redis: Redis, unique_prefix: str
) -> None:
    names = Names(unique_prefix)
    rid = uuid.uuid4().hex
    refused: list[tuple[str, int, int]] = []
    old_client = create_redis(url=redis_url, socket_timeout=5, retries=0, client_name=f"old-{unique_prefix}")
    # replica_ack on the shared Redis (no replica): the old owner keeps what it flushed, to re-append later.
    old = StreamPublisher(
        old_client,
        names,
        ttl_s=60,
        replica_ack=True,
        worker_id="old",
        on_fenced=lambda *args: refused.append(args),
    )
    new = StreamPublisher(redis, names, ttl_s=60, worker_id="new")
    try:
        first = await read_pickup_state(old, names, rid)
        assert first.epoch == 1 and not first.stream.exists
        old.add(token(rid, 0), epoch=first.epoch)
        await old.flush()
        taken = await read_pickup_state(new, names, rid)  # another worker picks the request up
        assert taken.epoch == 2 and taken.stream.next_seq == 1
        # The old owner goes on: its append and its record are refused as a whole, and it is told so.
        old.add(token(rid, 1), epoch=first.epoch)
        old.add(RecordWrite(names.request_key(rid), "stale", 60, rid), epoch=first.epoch)
        await old.flush()
        assert refused == [(rid, 1, 2)] and old.fenced == 1
        assert await redis.get(names.request_key(rid)) is None
        new.add(token(rid, 1), epoch=taken.epoch)
        usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
        new.add(DoneEvent(request_id=rid, seq=2, finish_reason="length", usage=usage), epoch=taken.epoch)
        await new.flush()
        assert await writers(redis, names, rid) == [(0, 1, "old"), (1, 2, "new"), (2, 2, "new")]
        assert 0 < await redis.ttl(names.stream_key(rid)) <= 60  # done expires the stream and its epoch
        assert 0 < await redis.ttl(names.epoch_key(rid)) <= 60
        # The old owner's connection drops while idle: the pool replaces it unseen, and the publisher re-appends
        # the event it kept for a replica, through the fence: refused, the stream unchanged.
        assert old.unconfirmed == 1
        victims = [c["id"] for c in await redis.client_list() if c.get("name") == f"old-{unique_prefix}"]
        assert victims
        for victim in victims:
            await redis.execute_command("CLIENT", "KILL", "ID", victim)
        await old.flush()
        assert old.reappended == 1 and old.fenced == 2 and old.unconfirmed == 0
        assert await writers(redis, names, rid) == [(0, 1, "old"), (1, 2, "new"), (2, 2, "new")]
    finally:
        await redis.delete(names.stream_key(rid), names.epoch_key(rid), names.request_key(rid))
        await old_client.aclose()


async def test_a_script_missing_from_the_server_is_loaded_again(tmp_path: Path) -> None:
    with private_redis(tmp_path) as server:
        client = create_redis(url=server.url, socket_timeout=5)
        publisher = StreamPublisher(client, Names("noscript"), ttl_s=60, worker_id="w")
        try:
            publisher.add(token("r", 0))
            await publisher.flush()  # a new server: NOSCRIPT, loaded, sent again
            await client.script_flush()  # as after a restart or a failover to a replica without it
            publisher.add(token("r", 1))
            await publisher.flush()
            assert publisher.retries == 2 and publisher.appended == 2
            assert [seq for seq, _, _ in await writers(client, Names("noscript"), "r")] == [0, 1]
        finally:
            await client.aclose()


@pytest.mark.slow
async def test_a_fenced_worker_stops_the_request_frees_its_kv_and_retakes_it_when_its_partition_stayed(
    kafka_bootstrap: str,
    redis_url: str,
    paced_model_dir: Path,  # noqa: F811
    unique_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpu_workers.worker")
    names = Names(unique_prefix)
    request = request_for(1500)
    rid = request.request_id
    # A longer session than the default 6 s: the test acts between the fence and the worker's retake.
    overrides = {"metrics_enabled": True, "worker_session_timeout_ms": 10_000}
    async with running_worker(kafka_bootstrap, redis_url, paced_model_dir, unique_prefix, **overrides) as worker:
        redis = worker.redis
        await publish(worker, request)
        deadline = time.monotonic() + 30
        while len(await read_events(redis, names, rid)) < 3:
            assert time.monotonic() < deadline, "the request never streamed"
            await asyncio.sleep(0.02)
        # Another owner takes the request over (as a worker that was given its partition would).
        new = StreamPublisher(redis, names, ttl_s=600, worker_id="new-owner")
        taken = await read_pickup_state(new, names, rid)
        assert taken.epoch == 2
        # The worker stops it at its next append (said in a log line), and the engine lets go of it: every KV
        # block free again in a heartbeat sent after the fence.
        deadline = time.monotonic() + 30
        while not (fenced := [r for r in caplog.records if r.getMessage() == "worker.fenced"]):
            assert time.monotonic() < deadline, "the worker was never fenced"
            await asyncio.sleep(0.02)
        assert len(fenced) == 1 and fenced[0].held_epoch == 2  # type: ignore[attr-defined]
        await wait_heartbeat_after(redis, names, time.time())
        await wait_idle_heartbeat(redis, names)
        before = await writers(redis, names, rid)
        assert {(epoch, writer) for _, epoch, writer in before} == {(1, "w-int")}
        assert [seq for seq, _, _ in before] == list(range(taken.stream.next_seq))  # nothing after the take-over
        # The new owner finishes it.
        seq = taken.stream.next_seq
        usage = Usage(prompt_tokens=1, completion_tokens=seq, total_tokens=seq + 1)
        new.add(DoneEvent(request_id=rid, seq=seq, finish_reason="length", usage=usage), epoch=taken.epoch)
        await new.flush()
        # The partition stayed with the worker (no member took it), so nobody else would end the request: a
        # session timeout later the worker picks it up again, finds it done and writes its final record.
        deadline = time.monotonic() + 30
        while (raw := await redis.get(names.request_key(rid))) is None or RequestRecord.model_validate_json(
            raw
        ).status != "finished":
            assert time.monotonic() < deadline, "the worker never retook the request"
            await asyncio.sleep(0.1)
        assert int(await redis.get(names.epoch_key(rid))) == 3
        after = await writers(redis, names, rid)
        assert after == [*before, (seq, 2, "new-owner")]
        worker.stop.set()
        stopped = await asyncio.wait_for(worker.task, 30)
        assert stopped.fence.fenced == 1
        assert stopped.telemetry is not None
        assert stopped.telemetry.fenced.labels(MODEL, "standard")._value.get() == 1
