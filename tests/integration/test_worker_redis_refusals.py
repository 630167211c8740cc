"""A worker on a real Redis that refuses writes for want of replicas (NOREPLICAS): a heartbeat is skipped and the
worker lives on (it once died of it, giving up its requests), and stream appends are held and retried as in an
outage, not failed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from private_redis import private_redis
from redis.asyncio import Redis

from gpu_workers.engine.outputs import EngineStats
from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.heartbeat import Heartbeats
from gpu_workers.worker.stream_state import read_stream_state
from gpu_workers.worker.streams import StreamPublisher
from schemas import Names, TokenEvent, WorkerHeartbeat
from sluicegate.task_stop import cancel_and_wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class _Producer:
    async def send(self, *args: Any, **kwargs: Any) -> asyncio.Future[None]:
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sent.set_result(None)
        return sent


def _engine() -> Any:
    stats = EngineStats(
        num_running=0,
        num_waiting=0,
        num_free_blocks=10,
        num_total_blocks=10,
        prefix_cache_hit_rate=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )
    tokenizer = SimpleNamespace(chat_template=None)  # not a fast tokenizer: nothing to publish
    return SimpleNamespace(
        stats=lambda: stats,
        tokenizer=tokenizer,
        is_running=True,
        max_model_len=512,
        architecture="LlamaForCausalLM",
        arithmetic="cpu eager steps, 1 threads, float32, torch 2",
    )


async def test_a_heartbeat_redis_refuses_is_skipped_and_the_next_one_goes_out(tmp_path: Path) -> None:
    names = Names("hb.")
    config = WorkerConfig(model_name="m", worker_id="w", heartbeat_interval_s=0.2)
    with private_redis(tmp_path) as server:
        redis = Redis.from_url(server.url)
        await redis.config_set("min-replicas-to-write", 1)  # every write: NOREPLICAS
        consumer: Any = SimpleNamespace(assignment=lambda: set())
        beats = Heartbeats(_engine(), config, names, redis, _Producer(), consumer, asyncio.Event())  # type: ignore[arg-type]
        running = asyncio.create_task(beats.run())
        try:
            await asyncio.sleep(0.7)  # three beats refused
            assert not running.done(), running.exception() if running.done() else None
            assert beats.last_written is None
            await redis.config_set("min-replicas-to-write", 0)
            for _ in range(50):
                if beats.last_written is not None:
                    break
                await asyncio.sleep(0.1)
            raw = await redis.hget(names.workers_key("m"), "w")
            assert raw is not None and WorkerHeartbeat.model_validate_json(raw).worker_id == "w"
        finally:
            await cancel_and_wait(running)
            await redis.aclose()


async def test_appends_redis_refuses_for_want_of_replicas_wait_and_go_out_once_it_takes_writes(
    tmp_path: Path,
) -> None:
    names = Names("nr.")
    with private_redis(tmp_path) as server:
        redis = Redis.from_url(server.url)
        publisher = StreamPublisher(redis, names, ttl_s=60)
        await redis.config_set("min-replicas-to-write", 1)
        publisher.add(TokenEvent(request_id="r1", seq=0, text="Hi", token_ids=[1]))
        flushing = asyncio.create_task(publisher.flush())  # retried through the refusal, as through an outage
        await asyncio.sleep(0.5)
        assert not flushing.done(), flushing.exception() if flushing.done() else None
        await redis.config_set("min-replicas-to-write", 0)
        await asyncio.wait_for(flushing, 10)
        assert (await read_stream_state(redis, names, "r1")).text == "Hi"
        await redis.aclose()
