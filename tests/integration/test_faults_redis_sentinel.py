"""Redis failover under live streams: a primary, a replica and three Sentinels (Debian's ``redis-server`` and
``redis-sentinel``, started here on free ports), the worker and the readers on a ``redis+sentinel://`` URL.
The primary is SIGKILLed while the worker streams; the Sentinels promote the replica and every client
follows it. Every stream must still end with its ``done``: seq 0..n, tokens equal to the uninterrupted run,
and a reader that follows the streams live sees no token twice and no gap.

A second test makes the asynchronous-replication window deterministic: the replica is stopped and cut off, so
appends the primary acknowledges never reach it, before the primary is killed and the replica promoted. The
worker's ``replica_ack`` (on by default for Sentinel URLs) must re-append them; with it off
(``SLUICEGATE_WORKER_REPLICA_ACK=false``) the promoted replica's streams have a gap and the test fails.

Prints one ``FAULT-REPORT`` line per test (run with ``-s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_report import count_events, fault_report
from needs import require
from redis.exceptions import RedisError
from test_worker import (  # noqa: F401  (module fixtures: model_dir, engine)
    PROMPT,
    engine,
    model_dir,
    publish,
    reference_run,
    request_for,
)

from benchmarks.redis_failover import SentinelSet, have_binaries
from gpu_workers.engine import AsyncEngine, SamplingParams
from gpu_workers.worker.main import run_worker
from schemas import STREAM_FIELD, Names, TokenEvent, WorkerHeartbeat, parse_stream_event
from sluicegate.kafka import create_admin
from sluicegate.redis_client import create_redis, wait_for_redis
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


@dataclass
class Worker:
    settings: Settings
    names: Names
    task: asyncio.Task[object]  # run_worker's; its result (the stopped worker) once the context has exited


@contextlib.asynccontextmanager
async def running_worker(kafka_bootstrap: str, redis_url: str, model_path: Path, prefix: str) -> AsyncIterator[Worker]:
    """The worker in this process on ``redis_url`` (a Sentinel URL), until it owns its partition."""
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=prefix,
        topic_partitions=1,
        model=str(model_path),
        model_name="tiny-worker",
        worker_id="w-sentinel",
        kv_cache_gb=0.05,
        heartbeat_interval_s=0.3,
        drain_timeout_s=5.0,
    )
    names = Names(prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, stop))
    redis = create_redis(url=redis_url, socket_timeout=5)
    try:
        deadline = time.monotonic() + 120  # the engine's start-up takes a minute on a busy shared box
        while True:
            assert time.monotonic() < deadline, "the worker never owned its partition"
            assert not task.done(), task.exception()
            with contextlib.suppress(OSError, RedisError):
                beats = await redis.hgetall(names.workers_key("tiny-worker"))
                if any(WorkerHeartbeat.model_validate_json(v).partitions for v in beats.values()):
                    break
            await asyncio.sleep(0.1)
        yield Worker(settings, names, task)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        admin = create_admin(bootstrap=kafka_bootstrap)
        await admin.start()
        with contextlib.suppress(Exception):
            await admin.delete_topics([t for t in await admin.list_topics() if t.startswith(prefix)])
        await admin.close()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    require(have_binaries(), "redis-server and redis-sentinel", "apt-get install redis-sentinel")
    group = SentinelSet(tmp_path)
    try:
        group.start()
        yield group
    finally:
        group.stop()


async def follow(
    url: str, names: Names, request_ids: list[str], seen: dict[str, list[int]], arrivals: list[float]
) -> None:
    """A live reader on the Sentinel URL: XREAD from the last id it has, recording every seq it receives."""
    client = create_redis(url=url, socket_timeout=5)
    last = {names.stream_key(rid): "0-0" for rid in request_ids}
    done: set[str] = set()
    try:
        while len(done) < len(request_ids):
            try:
                answer = await client.xread({k: v for k, v in last.items() if k not in done}, block=500)
            except (RedisError, OSError):
                await asyncio.sleep(0.1)
                continue
            for key, entries in answer or []:
                key = key.decode()
                rid = key.rsplit(":", 1)[-1]
                for entry_id, fields in entries:
                    event = parse_stream_event(fields[STREAM_FIELD.encode()])
                    seen[rid].append(event.seq)
                    arrivals.append(time.monotonic())
                    last[key] = entry_id.decode()
                    if event.type in ("done", "error"):
                        done.add(key)
    finally:
        await client.aclose()


async def reference_tokens(sentinels: SentinelSet, reference: AsyncEngine, max_tokens: int) -> list[int]:
    """Once the Sentinels see a synced replica: the uninterrupted greedy run's tokens for ``PROMPT``."""
    await wait_for_redis(sentinels.url, timeout_s=20)
    await sentinels.replica_in_sync()
    prompt_ids = list(reference.tokenizer.encode(PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return (await reference_run(reference, prompt_ids, params)).token_ids


@dataclass
class LiveStreams:
    """A worker on the Sentinel URL serving ``n`` greedy requests, followed live by :func:`follow`."""

    worker: Worker
    seen: dict[str, list[int]]
    arrivals: list[float]
    reader: asyncio.Task[None]


@contextlib.asynccontextmanager
async def live_streams(
    kafka_bootstrap: str, sentinels: SentinelSet, model_path: Path, prefix: str, n: int, max_tokens: int
) -> AsyncIterator[LiveStreams]:
    requests = [request_for(max_tokens) for _ in range(n)]
    async with running_worker(kafka_bootstrap, sentinels.url, model_path, prefix) as worker:
        seen: dict[str, list[int]] = {r.request_id: [] for r in requests}
        arrivals: list[float] = []
        reader = asyncio.create_task(follow(sentinels.url, worker.names, list(seen), seen, arrivals))
        await publish(worker, *requests)
        yield LiveStreams(worker, seen, arrivals, reader)


async def seen_each(seen: dict[str, list[int]], n: int) -> dict[str, int]:
    """Until the live reader has ``n`` events of every stream; how many it has of each."""
    deadline = time.monotonic() + 30
    while min(len(v) for v in seen.values()) < n:
        assert time.monotonic() < deadline, {k: len(v) for k, v in seen.items()}
        await asyncio.sleep(0.02)
    return {rid: len(v) for rid, v in seen.items()}


async def assert_streams_complete(url: str, names: Names, seen: dict[str, list[int]], tokens: list[int]) -> bytes:
    """Every stream on the current primary is seq 0..n with one ``done`` last and the uninterrupted tokens, and
    the live reader saw exactly that; returns the role of the server answering (``master``)."""
    client = create_redis(url=url, socket_timeout=5)
    try:
        role = await client.execute_command("ROLE")
        for rid in seen:
            entries = await client.xrange(names.stream_key(rid))
            events = [parse_stream_event(f[STREAM_FIELD.encode()]) for _, f in entries]
            seqs = [e.seq for e in events]
            assert seqs == list(range(len(events))), f"{rid}: the stream has a gap or a duplicate: {seqs}"
            assert [e.type for e in events].count("done") == 1 and events[-1].type == "done"
            assert [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids] == tokens
            assert seen[rid] == seqs, f"{rid}: the live reader saw {seen[rid][:5]}... != stream"
    finally:
        await client.aclose()
    return bytes(role[0])


async def final_seqs(url: str, names: Names, request_ids: list[str]) -> dict[str, int]:
    """Each stream's last seq on the current primary (its ``done``, checked by :func:`assert_streams_complete`)."""
    client = create_redis(url=url, socket_timeout=5)
    try:
        last = {rid: await client.xrevrange(names.stream_key(rid), count=1) for rid in request_ids}
    finally:
        await client.aclose()
    return {rid: parse_stream_event(entries[0][1][STREAM_FIELD.encode()]).seq for rid, entries in last.items()}


async def test_primary_killed_mid_stream_every_stream_ends_once(
    kafka_bootstrap: str,
    model_dir: Path,  # noqa: F811
    engine: AsyncEngine,  # noqa: F811
    sentinels: SentinelSet,
    unique_prefix: str,
) -> None:
    max_tokens = 400
    tokens = await reference_tokens(sentinels, engine, max_tokens)
    async with live_streams(kafka_bootstrap, sentinels, model_dir, unique_prefix, 3, max_tokens) as live:
        seen, arrivals = live.seen, live.arrivals
        at_kill = await seen_each(seen, 10)
        sentinels.kill("primary")
        killed = time.monotonic()
        await asyncio.wait_for(live.reader, 120)
        finished_s = time.monotonic() - killed
        role = await assert_streams_complete(sentinels.url, live.worker.names, seen, tokens)
    assert role == b"master"
    assert all(0 < n < max_tokens for n in at_kill.values()), at_kill
    fault_report(
        "redis_sentinel_failover",
        count_events(seen, await final_seqs(sentinels.url, live.worker.names, list(seen))),
        requests=len(seen),
        tokens_each=max_tokens,
        events_seen_at_kill=sorted(at_kill.values()),
        kill_to_all_done_s=round(finished_s, 2),
        longest_pause_s=round(max(b - a for a, b in itertools.pairwise(arrivals)), 2),
        promoted=role.decode(),
    )


async def test_appends_the_replica_never_received_are_restored_after_failover(
    kafka_bootstrap: str,
    model_dir: Path,  # noqa: F811
    engine: AsyncEngine,  # noqa: F811
    sentinels: SentinelSet,
    unique_prefix: str,
) -> None:
    max_tokens = 200
    tokens = await reference_tokens(sentinels, engine, max_tokens)
    primary = create_redis(url=f"redis://127.0.0.1:{sentinels.ports['primary']}/0", socket_timeout=5)
    async with live_streams(kafka_bootstrap, sentinels, model_dir, unique_prefix, 2, max_tokens) as live:
        seen, arrivals = live.seen, live.arrivals
        at_cut = await seen_each(seen, 10)
        # SIGSTOP alone is not enough: the kernel would still take the replication stream into the stopped
        # replica's socket buffer and it would read it on SIGCONT. Dropping the link while it is stopped means
        # nothing the primary acknowledges from now on reaches the replica.
        sentinels.signal("replica", signal.SIGSTOP)
        await primary.execute_command("CLIENT", "KILL", "TYPE", "replica")
        at_kill = await seen_each(seen, max(at_cut.values()) + 20)  # appended on the primary alone
        await primary.aclose()
        sentinels.kill("primary")
        sentinels.signal("replica", signal.SIGCONT)
        killed = time.monotonic()
        await asyncio.wait_for(live.reader, 120)
        finished_s = time.monotonic() - killed
        # With replica_ack off the promoted replica lacks the events appended after the cut: a gap here.
        role = await assert_streams_complete(sentinels.url, live.worker.names, seen, tokens)
    publisher = live.worker.task.result().outputs.publisher  # type: ignore[attr-defined]
    assert role == b"master"
    assert all(at_cut[rid] < at_kill[rid] < max_tokens for rid in seen), (at_cut, at_kill)
    fault_report(
        "redis_failover_unreplicated_appends",
        count_events(seen, await final_seqs(sentinels.url, live.worker.names, list(seen))),
        requests=len(seen),
        tokens_each=max_tokens,
        events_seen_at_cut=sorted(at_cut.values()),
        events_seen_at_kill=sorted(at_kill.values()),
        reappended=publisher.reappended,
        kill_to_next_event_s=round(min(t for t in arrivals if t > killed) - killed, 2),
        kill_to_all_done_s=round(finished_s, 2),
    )


def test_sentinel_urls_parse_for_redis_py_and_kombu() -> None:
    from sluicegate.batches.celery_app import kombu_broker
    from sluicegate.kafka import replication_plan
    from sluicegate.redis_urls import parse_sentinel_url

    target = parse_sentinel_url("redis+sentinel://h1:1,h2:2/svc/3")
    assert (target.sentinels, target.service, target.db, target.password) == ([("h1", 1), ("h2", 2)], "svc", 3, None)
    assert parse_sentinel_url("redis+sentinel://:pw@h1:1/svc").password == "pw"
    for bad in ("redis+sentinel://h1/svc", "redis+sentinel://h1:1/", "redis+sentinel://h1:1/svc/x"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)
    assert kombu_broker("redis+sentinel://h1:1,h2:2/svc/3") == (
        "sentinel://h1:1/3;sentinel://h2:2/3",
        {"master_name": "svc"},
        None,
    )
    assert kombu_broker("redis://h:1/0") == ("redis://h:1/0", {}, None)
    # One broker: 1 replica; three: 3 replicas and 2 in sync; auto off keeps what was asked for.
    assert replication_plan(1, 1, True) == (1, 1)
    assert replication_plan(1, 3, True) == (3, 2)
    assert replication_plan(1, 5, True) == (3, 2)
    assert replication_plan(1, 3, False) == (1, 1)
