"""A worker whose engine runs tensor-parallel (2 ranks under gloo) loses a rank mid-stream: the rank's death
fails the engine's step instead of hanging it, the worker stops, and the request continues on the other
(tensor-parallel) worker from the tokens already delivered. The client (the official ``openai`` SDK, streaming)
reads exactly the uninterrupted greedy text of the unsplit model."""

from __future__ import annotations

import signal

import psutil
import pytest

from schemas import RestartEvent

from .conftest import Pipeline
from .sdk_stream import SdkCompletionStream
from .test_recovery import MAX_TOKENS, PROMPT, ensure_workers, llm, reference, tiny_model_dir, wait_owner

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
__all__ = ["llm", "reference", "tiny_model_dir"]  # the paced model and its greedy reference, from test_recovery


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "SLUICEGATE_TENSOR_PARALLEL_SIZE": "2"}


def rank_processes(worker_pid: int) -> list[psutil.Process]:
    """The worker's tensor-parallel rank processes (multiprocessing spawn children of its engine process)."""
    children = psutil.Process(worker_pid).children(recursive=True)
    return [p for p in children if any("spawn_main" in part for part in p.cmdline())]


def test_a_dead_rank_fails_its_worker_over(pipeline: Pipeline, reference: str) -> None:
    ensure_workers(pipeline)
    client = SdkCompletionStream(pipeline, PROMPT, MAX_TOKENS)
    rid = client.start_until(pipeline, 40)
    owner = wait_owner(pipeline, rid)
    service = pipeline.find(owner)
    (rank,) = rank_processes(service.process.pid)
    rank.send_signal(signal.SIGKILL)
    delivered = pipeline.stream_events(rid)
    assert delivered and delivered[-1].type == "token", "the rank was not killed mid-generation"
    # The owner notices at its next step and stops (its requests go back to Kafka), rather than hang.
    service.process.wait(timeout=60)
    assert "engine" in service.log().lower()

    events = pipeline.wait_stream_end(rid, timeout_s=120)
    assert events[-1].type == "done", events[-1]
    assert not any(isinstance(e, RestartEvent) for e in events), "continued, not started over"
    assert [e.seq for e in events] == list(range(len(events)))
    assert pipeline.record(rid).worker_id != owner
    client.join(timeout=60)
    assert client.error is None, client.error
    assert client.texts == [reference] and client.finish == ["length"]
