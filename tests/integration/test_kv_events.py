"""KV events on real Kafka: a worker (in-process, tiny random model) publishes a snapshot at start and each step's
cached blocks; a router's follower reads them into its index, asks for a snapshot when it joins late, and the
index then holds exactly the blocks the router computes for the prompt the worker served."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from test_worker import MODEL, publish, running_worker
from transformers import AutoTokenizer

from router.kv_follower import KVFollower
from router.kv_index import KVIndex, short_hash
from schemas import InferenceRequest, SamplingOptions, WorkerHeartbeat
from sluicegate.block_hashes import prompt_block_hashes

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv-model") / MODEL, num_layers=2, hidden_size=64)


PROMPT = "The river ran quietly past the old mill, and the miller counted the sacks of flour one by one."


async def _until(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_late_router_catches_up_and_indexes_the_served_prompt(
    kafka_bootstrap: str,
    redis_url: str,
    model_dir: Path,
    unique_prefix: str,
) -> None:
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, block_size=4) as worker:
        # The router joins after the worker's start snapshot went out: it must ask for one.
        index = KVIndex()
        follower = KVFollower(worker.settings, index, service="test")
        follower.start()
        try:
            await asyncio.wait_for(follower.positioned.wait(), 30)
            await _until(lambda: index.worker(MODEL, "w-int") is not None, "the worker's snapshot")
            assert index.worker(MODEL, "w-int").in_sync
            request = InferenceRequest(
                request_id=uuid.uuid4().hex,
                model=MODEL,
                prompt=PROMPT,
                sampling=SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True),
            )
            await publish(worker, request)
            ids = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT).input_ids
            hashes = [short_hash(h) for h in prompt_block_hashes(ids, 4)]
            assert len(hashes) >= 4
            await _until(
                lambda: index.matched_blocks(MODEL, "w-int", hashes) == len(hashes), "the prompt's blocks indexed"
            )
            assert index.worker(MODEL, "w-int").in_sync  # no gap in the worker's seq
            # The heartbeat reports how far the worker's events went; the index has read that far.
            await asyncio.sleep(3 * worker.settings.heartbeat_interval_s)
            raw = await worker.redis.hget(worker.names.workers_key(MODEL), "w-int")
            beat = WorkerHeartbeat.model_validate_json(raw)
            assert beat.kv_events_seq is not None
            assert index.fresh(MODEL, beat, max_lag_s=0.0)
        finally:
            await follower.close()
