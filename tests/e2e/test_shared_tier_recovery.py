"""``kill -9`` of the worker generating a request, with the shared KV tier on (a redis-server of its own, as it is
deployed): the next owner resumes the request from the blocks the dead worker wrote there as they filled, instead
of prefilling its prompt and delivered tokens again, and the client still gets the text of an uninterrupted run."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from private_redis import RedisServer, private_redis

from gpu_workers.engine.config import EngineConfig
from schemas import DoneEvent, TokenEvent

from .conftest import Pipeline
from .test_recovery import (  # the paced model and the greedy reference of test_recovery
    MAX_TOKENS,
    PROMPT,
    ensure_workers,
    llm,
    reference,
    tiny_model_dir,
    wait_owner,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
__all__ = ["llm", "reference", "tiny_model_dir"]  # module fixtures shared with test_recovery

BLOCK_SIZE = EngineConfig.block_size  # the workers' KV block size: the engine's default


@pytest.fixture(scope="module")
def shared_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with private_redis(tmp_path_factory.mktemp("shared-tier")) as server:
        yield server


@pytest.fixture(scope="module")
def pipeline_env(shared_tier: RedisServer) -> dict[str, str]:
    # One intra-op thread per worker (several processes share two cores); every worker reads and writes the tier.
    return {"OMP_NUM_THREADS": "1", "SLUICEGATE_KV_SHARED_TIER_URL": shared_tier.url}


def finished_cached_tokens(pipeline: Pipeline, worker: str, request_id: str, timeout_s: float = 30) -> int:
    """``cached_tokens`` of the worker's ``worker.finished`` line for the request (what its last prefill found);
    the line follows the stream's ``done``."""
    pattern = re.compile(rf"worker\.finished request_id={request_id} .*?cached_tokens=(\d+)")
    deadline = time.monotonic() + timeout_s
    while True:
        log = pipeline.find(worker).log()
        if found := pattern.search(log):
            return int(found.group(1))
        assert time.monotonic() < deadline, f"no worker.finished line for {request_id}:\n{log[-3000:]}"
        time.sleep(0.1)


def test_a_killed_workers_request_resumes_from_the_shared_tier(pipeline: Pipeline, reference: str) -> None:
    ensure_workers(pipeline)
    accepted = pipeline.submit(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    rid = accepted["request_id"]
    owner = wait_owner(pipeline, rid)
    # Kill it once several blocks of prompt and output have filled (and been written down behind the step).
    deadline = time.monotonic() + 60
    while len(pipeline.stream_events(rid)) < 60:
        assert time.monotonic() < deadline, "the request did not stream"
        time.sleep(0.05)
    pipeline.kill(pipeline.find(owner))
    delivered = len(pipeline.stream_events(rid))
    assert delivered < MAX_TOKENS - 50, "the worker was not killed mid-generation"
    deadline = time.monotonic() + 120
    while not (events := pipeline.stream_events(rid)) or not isinstance(events[-1], DoneEvent):
        assert time.monotonic() < deadline, "the request did not finish on the other worker"
        time.sleep(0.1)

    assert [e.seq for e in events] == list(range(len(events))), "gap or duplicate"
    assert all(isinstance(e, TokenEvent | DoneEvent) for e in events), "a restart or an error: not a pause"
    assert "".join(getattr(e, "text", "") or "" for e in events) == reference
    survivor = pipeline.record(rid).worker_id
    assert survivor is not None and survivor != owner
    # The resume prefill (prompt + at least 60 delivered tokens: four full blocks or more) finds them in the shared
    # tier; its writer may lag a block. Without the tier the survivor finds only what its own pool kept from before
    # a rebalance moved the request (one block, in a run with the tier off).
    cached = finished_cached_tokens(pipeline, str(survivor), rid)
    assert cached >= 3 * BLOCK_SIZE and cached % BLOCK_SIZE == 0, cached
