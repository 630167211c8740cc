"""The KV offload tiers through a whole worker on real Kafka and Redis (in-process, tiny random model): a worker
restarted on the same disk-tier folder re-publishes what the folder holds in its start snapshot, and its first
turn's prompt is served from it (``cached_tokens`` in the usage the API reports), not recomputed."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from test_worker import MODEL, publish, running_worker, wait_terminal
from transformers import AutoTokenizer

from router.kv_follower import KVFollower
from router.kv_index import KVIndex, short_hash
from schemas import DoneEvent, InferenceRequest, SamplingOptions, TokenEvent
from sluicegate.block_hashes import prompt_block_hashes

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
