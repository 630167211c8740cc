"""The shared KV tier on a real Redis of its own: what one engine wrote as its blocks filled, another engine (the
worker a request resumes on after the first died, without having flushed or shut down) loads instead of
recomputing, with the same greedy tokens; and a store that goes away makes lookups recompute, not fail."""

from __future__ import annotations

import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
import redis
from needs import require_tool
from ports import free_port

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.worker.kv_tiers import RedisBlockStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=96, num_kv_blocks=32, dtype="float32")


@pytest.fixture
def shared_redis(tmp_path: Path):
    """A redis-server of its own, as the shared tier is deployed (a cache: LRU, no persistence)."""
    server = require_tool("redis-server", "apt-get install redis-server")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield url, proc
    proc.terminate()
    proc.wait(timeout=10)


def test_a_resumed_request_loads_its_prompt_from_the_shared_tier(tmp_path: Path, shared_redis) -> None:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    url, proc = shared_redis
    model = make_tiny_model(tmp_path / "model", num_layers=2, hidden_size=64)
    tiers = dict(shared_store=partial(RedisBlockStore, url))
    prompt = list(range(3, 3 + 61))  # fifteen full blocks before the last token
    dead = LLM(str(model), **ENGINE, kv_offload=tiers)
    expected = dead.generate([prompt], GREEDY)[0].token_ids
    dead.engine.offloader.flush()  # the writer is behind at most a few blocks; the test wants them all
    # The first worker is gone without a shutdown (its pool with it); the request resumes on another.
    survivor = LLM(str(model), **ENGINE, kv_offload=tiers)
    out = survivor.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected
    assert out.num_cached_tokens == 60
    assert survivor.engine.stats().kv_offload.hits["shared"] == 15
    proc.terminate()
    proc.wait(timeout=10)
    third = LLM(str(model), **ENGINE, kv_offload=tiers)  # the store is down: recompute
    out = third.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected and out.num_cached_tokens == 0
    for llm in (dead, survivor, third):
        llm.engine.close()
