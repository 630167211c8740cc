"""The KV offload tiers through a whole worker on real Kafka and Redis (in-process, tiny random model): a worker
restarted on the same disk-tier folder re-publishes what the folder holds in its start snapshot, and its first
turn's prompt is served from it (``cached_tokens`` in the usage the API reports), not recomputed; and with two
workers, a router that follows their KV events sends a conversation's next turn to the one holding its history."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_worker import MODEL, publish, running_worker, wait_terminal
from transformers import AutoTokenizer

from router.kv_follower import KVFollower
from router.kv_index import KVIndex, short_hash
from router.policy import owned_partitions
from router.router import Router
from schemas import DoneEvent, InferenceRequest, SamplingOptions, TokenEvent, WorkerHeartbeat
from schemas.names import HEADER_REQUEST_ID
from sluicegate.block_hashes import prompt_block_hashes
from sluicegate.kafka import create_producer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

BLOCK = 4
SYSTEM = "You are a careful assistant for the mill. Answer in one short sentence, and name the sack you counted. "
PROMPT = SYSTEM + "The river ran quietly past the old mill, and the miller counted the sacks of flour one by one."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv-tier-model") / MODEL, num_layers=2, hidden_size=64)


def _request(prompt: str) -> InferenceRequest:
    return InferenceRequest(
        request_id=uuid.uuid4().hex,
        model=MODEL,
        prompt=prompt,
        sampling=SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True),
    )


async def _until(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _outcome(events: list) -> tuple[list[int], int]:
    done = events[-1]
    assert isinstance(done, DoneEvent), events[-1]
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids], done.usage.cached_tokens


async def test_a_restarted_worker_republishes_its_disk_tier_and_its_first_turn_hits_it(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, unique_prefix: str, tmp_path: Path
) -> None:
    disk = tmp_path / "kv-disk" / "worker"
    ids = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT).input_ids
    hashes = [short_hash(h) for h in prompt_block_hashes(ids, BLOCK)]
    assert len(hashes) >= 8
    tiers = dict(block_size=BLOCK, kv_disk_tier_dir=str(disk), kv_disk_tier_gb=0.01)
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, **tiers) as first:
        request = _request(PROMPT)
        await publish(first, request)
        expected, cached = _outcome(await wait_terminal(first.redis, first.names, request.request_id))
        assert cached == 0  # a cold worker computed the prompt
        # Written as the blocks filled, by the engine's writer thread: wait for the prompt's blocks on disk.
        await _until(lambda: len(list(disk.rglob("*.kvblock"))) >= len(hashes), "the prompt's blocks on disk")

    # The same worker id on the same folder, its pool empty: a router that was listening before it started learns
    # the folder's blocks from its start snapshot alone.
    index = KVIndex()
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, **tiers) as again:
        follower = KVFollower(again.settings, index, service="test")
        follower.start()
        try:
            await asyncio.wait_for(follower.positioned.wait(), 30)
            await _until(lambda: index.worker(MODEL, "w-int") is not None, "the restarted worker's snapshot")
            disk_only = {"disk": 1.0}
            await _until(
                lambda: index.weighted_blocks(MODEL, "w-int", hashes, disk_only) == len(hashes),
                "the disk tier's blocks in the snapshot",
            )
            assert index.matched_blocks(MODEL, "w-int", hashes) == 0  # not in its pool: only on disk
            request = _request(PROMPT)
            await publish(again, request)
            tokens, cached = _outcome(await wait_terminal(again.redis, again.names, request.request_id))
        finally:
            await follower.close()
    assert cached == len(hashes) * BLOCK  # every full block before the last token, from the disk tier
    assert tokens == expected  # float32 greedy: loaded K/V give the tokens computed ones gave


async def _live_beats(redis, names, ids: set[str], topic: str) -> list[WorkerHeartbeat]:
    """The workers' heartbeats once each owns a partition of ``topic`` of its own (the group has settled)."""
    deadline = time.monotonic() + 60
    while True:
        raw = await redis.hgetall(names.workers_key(MODEL))
        beats = [WorkerHeartbeat.model_validate_json(v) for v in raw.values()]
        beats = [b for b in beats if b.worker_id in ids]
        owned = [owned_partitions(b, topic, 2) for b in beats]
        if len(beats) == len(ids) and all(len(p) == 1 for p in owned) and owned[0] != owned[1]:
            return beats
        assert time.monotonic() < deadline, f"the two workers never split the partitions: {beats}"
        await asyncio.sleep(0.1)


async def test_a_conversations_next_turn_goes_to_the_worker_holding_its_history(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, unique_prefix: str
) -> None:
    """Two workers share a topic's two partitions; turn one ran on "w-b", the worker the tie-break would not pick
    (an empty cache on both, equal load: the lower worker id wins); the router, from the workers' KV events, sends
    turn two to "w-b" (reason ``cached_prefix``, counted in ``sluicegate_kv_routing``), whose cache serves the
    history."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    common = dict(topic_partitions=2, block_size=BLOCK)
    async with (
        running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, worker_id="w-a", **common) as a,
        running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, worker_id="w-b", **common),
    ):
        topic = a.names.request_topic(MODEL, "standard")
        beats = await _live_beats(a.redis, a.names, {"w-a", "w-b"}, topic)
        holder = next(b for b in beats if b.worker_id == "w-b")
        first = _request(PROMPT)
        producer = create_producer(a.settings)
        await producer.start()
        try:
            await producer.send_and_wait(
                topic,
                first.model_dump_json().encode(),
                partition=owned_partitions(holder, topic, 2)[0],
                headers=[(HEADER_REQUEST_ID, first.request_id.encode())],
            )
            events = await wait_terminal(a.redis, a.names, first.request_id)
            reply = "".join(e.text for e in events if isinstance(e, TokenEvent))

            registry = CollectorRegistry()
            router = Router.from_settings(a.settings, kv_index=KVIndex(), registry=registry)
            assert router.kv is not None
            follower = KVFollower(a.settings, router.kv.index, service="test")
            follower.start()
            try:
                await asyncio.wait_for(follower.positioned.wait(), 30)
                turn_one = [short_hash(h) for h in prompt_block_hashes(tokenizer(PROMPT).input_ids, BLOCK)]
                await _until(
                    lambda: router.kv.index.matched_blocks(MODEL, "w-b", turn_one) == len(turn_one), "turn one indexed"
                )
                # Fresh heartbeats, which report how far each worker's events went (the index has read that far).
                await asyncio.sleep(3 * a.settings.heartbeat_interval_s)
                router.set_heartbeats(MODEL, await _live_beats(a.redis, a.names, {"w-a", "w-b"}, topic))
                router.set_partitions(topic, 2)
                second = _request(PROMPT + reply + " And which sack came next?")
                chosen = router.route(second, prompt_ids=tokenizer(second.prompt).input_ids)
            finally:
                await follower.close()
            assert chosen.reason == "cached_prefix", chosen
            assert chosen.partition == owned_partitions(holder, topic, 2)[0]
            counted = {"model": MODEL, "outcome": "cached_prefix"}
            assert registry.get_sample_value("sluicegate_kv_routing_total", counted) == 1
            await producer.send_and_wait(
                chosen.topic,
                second.model_dump_json().encode(),
                key=chosen.key,
                partition=chosen.partition,
                headers=[(HEADER_REQUEST_ID, second.request_id.encode())],
            )
            _, cached = _outcome(await wait_terminal(a.redis, a.names, second.request_id))
        finally:
            await producer.stop()
    assert cached >= len(turn_one) * BLOCK  # turn one's prompt, from the pool of the worker that ran it
