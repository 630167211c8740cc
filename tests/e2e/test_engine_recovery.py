"""Crash recovery with the engine's scale features on: both workers run n-gram speculation over a model split
into 2 tensor-parallel ranks (gloo). The client (the official ``openai`` SDK, streaming) must read exactly the
non-speculative, unsplit greedy output across:

- ``kill -9`` of the owning worker mid-stream: the next owner continues from the tokens the stream delivered
  (speculating, several tokens per step), with no gap, duplicate or restart; both workers' acceptance counters
  prove drafts were accepted;
- the death of one of the owner's ranks mid-stream: its engine's step fails instead of hanging, the worker stops,
  and the request continues on the other worker.

The prompt is edit-shaped (P + the model's own greedy continuation O + P) and the model is the paced one's shape
with a small init (0.02), whose greedy output falls into loops the n-gram proposer predicts (the paced model's
larger init never repeats, so nothing would be accepted)."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_workers.engine import LLM, RequestOutput, SamplingParams
from schemas import RestartEvent, TokenEvent

from .conftest import Pipeline, free_port
from .sdk_stream import SdkCompletionStream
from .test_recovery import PROMPT, WORKERS, ensure_workers, llm, wait_owner

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
__all__ = ["llm"]  # the reference fixture shared with test_recovery (on this module's model)

MAX_TOKENS = 400
ACCEPTED = "sluicegate:spec_decode_num_accepted_tokens"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "looping"
    return make_tiny_model(out, arch="llama", num_layers=6, hidden_size=384, init_std=0.02)


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "SLUICEGATE_SPECULATIVE_METHOD": "ngram",
        "SLUICEGATE_NUM_SPECULATIVE_TOKENS": "4",
        "SLUICEGATE_TENSOR_PARALLEL_SIZE": "2",
    }


@pytest.fixture(scope="module")
def edit_prompt(llm: LLM) -> tuple[list[int], RequestOutput]:
    """The edit-shaped prompt, and the reference output of the unsplit model without speculation."""
    head = llm.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    continuation = llm.generate([head], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    prompt = head + continuation[0].token_ids + head
    return prompt, llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]


def accepted_drafts(port: int) -> float:
    """The worker's accepted draft tokens so far, from its /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (ACCEPTED, f"{ACCEPTED}_total"):
                return sample.value
    raise AssertionError(f"{ACCEPTED} not exported")


def assert_continued_exactly(
    pipeline: Pipeline, client: SdkCompletionStream, rid: str, owner: str, expected: RequestOutput
) -> str:
    """The request ran to the end on another worker with exactly ``expected``'s tokens, without a restart or a
    gap, and the SDK client read exactly its text; returns the worker that finished it."""
    events = pipeline.wait_stream_end(rid, timeout_s=120)
    assert events[-1].type == "done", events[-1]
    assert not any(isinstance(e, RestartEvent) for e in events), "continued, not started over"
    assert [e.seq for e in events] == list(range(len(events)))
    ids = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    assert ids == expected.token_ids, "the output across the crash differs from plain, unsplit greedy decoding"
    successor = str(pipeline.record(rid).worker_id)
    assert successor != owner
    client.join(timeout=60)
    assert client.error is None, client.error
    assert client.texts == [expected.text] and client.finish == ["length"]
    return successor


def rank_processes(worker_pid: int) -> list[psutil.Process]:
    """The worker's tensor-parallel rank processes (multiprocessing spawn children of its engine process)."""
    children = psutil.Process(worker_pid).children(recursive=True)
    return [p for p in children if any("spawn_main" in part for part in p.cmdline())]


def test_speculative_request_continues_exactly_after_a_worker_crash(
    pipeline: Pipeline, edit_prompt: tuple[list[int], RequestOutput]
) -> None:
    # Both workers with a metrics port of their own (the fixture's worker-a has none).
    ports = {name: free_port() for name in WORKERS}
    for service in [s for s in pipeline.services if s.name in WORKERS and s.alive()]:
        pipeline.kill(service)
    for name in WORKERS:
        pipeline.start_worker(name, SLUICEGATE_WORKER_METRICS_PORT=str(ports[name]))
    ensure_workers(pipeline)

    prompt, expected = edit_prompt
    client = SdkCompletionStream(pipeline, prompt, MAX_TOKENS)
    rid = client.start_until(pipeline, 40)
    owner = wait_owner(pipeline, rid)
    accepted_before_crash = accepted_drafts(ports[owner])
    pipeline.kill(pipeline.find(owner))
    delivered = pipeline.stream_events(rid)
    assert delivered and delivered[-1].type == "token", "the worker was not killed mid-generation"
    assert sum(len(e.token_ids) for e in delivered if isinstance(e, TokenEvent)) < MAX_TOKENS - 50
    assert accepted_before_crash > 0, "the first owner never accepted a draft: the test proves nothing"

    successor = assert_continued_exactly(pipeline, client, rid, owner, expected)
    assert accepted_drafts(ports[successor]) > 0, "the new owner did not speculate"
    assert client.usage.completion_tokens == MAX_TOKENS


def test_a_dead_rank_fails_its_worker_over(pipeline: Pipeline, edit_prompt: tuple[list[int], RequestOutput]) -> None:
    ensure_workers(pipeline)
    prompt, expected = edit_prompt
    client = SdkCompletionStream(pipeline, prompt, MAX_TOKENS)
    rid = client.start_until(pipeline, 40)
    owner = wait_owner(pipeline, rid)
    service = pipeline.find(owner)
    (rank,) = rank_processes(service.process.pid)
    rank.send_signal(signal.SIGKILL)
    delivered = pipeline.stream_events(rid)
    assert delivered and delivered[-1].type == "token", "the rank was not killed mid-generation"
    # The owner notices at its next step and stops (its requests go back to Kafka), rather than hang.
    service.process.wait(timeout=60)
    assert "worker.engine_failed" in service.log_path.read_text(errors="replace"), service.log()

    assert_continued_exactly(pipeline, client, rid, owner, expected)
