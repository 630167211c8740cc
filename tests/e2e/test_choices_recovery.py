"""A request with several choices (``n`` = 3) survives ``kill -9`` of its worker mid-stream: the next owner
continues every choice from the tokens its stream delivered, as it does for one choice, instead of starting
over. Two requests share the prompt (so prefix affinity puts them on one worker): a greedy one read with the
official ``openai`` SDK over server-sent events, whose every choice must equal the uninterrupted greedy text,
and a sampled one through the native API, whose every choice must run to exactly ``max_tokens`` tokens with
text that is the seamless decoding of its own tokens."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpu_workers.engine import LLM
from schemas import RestartEvent, TokenEvent

from .conftest import Pipeline
from .sdk_stream import SdkCompletionStream
from .test_recovery import (  # the paced model, one OpenMP thread per service, and the greedy reference
    MAX_TOKENS,
    PROMPT,
    ensure_workers,
    expected_text,
    llm,
    pipeline_env,
    reference,
    tiny_model_dir,
    wait_owner,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
__all__ = ["llm", "pipeline_env", "reference", "tiny_model_dir"]  # module fixtures shared with test_recovery

N = 3


def _choice_tokens(events: list[Any], index: int) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent) and e.index == index]


def test_every_choice_continues_from_its_delivered_tokens_after_a_worker_crash(
    pipeline: Pipeline, llm: LLM, reference: str
) -> None:
    ensure_workers(pipeline)
    sse = SdkCompletionStream(pipeline, PROMPT, MAX_TOKENS, n=N)
    sse.start()
    sampled = pipeline.submit(prompt=PROMPT, n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True)
    rid = sampled["request_id"]
    owner = wait_owner(pipeline, rid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        events = pipeline.stream_events(rid)
        if sse.request_id and all(len(_choice_tokens(events, i)) >= 20 for i in range(N)):
            break
        time.sleep(0.01)
    assert sse.request_id is not None and wait_owner(pipeline, sse.request_id) == owner, "prefix affinity"
    pipeline.kill(pipeline.find(owner))
    delivered = {r: pipeline.stream_events(r) for r in (rid, sse.request_id)}
    for events in delivered.values():
        assert events and events[-1].type == "token", "the worker was not killed mid-generation"
        assert sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)) < N * MAX_TOKENS - 50

    for request_id in (rid, sse.request_id):
        events = pipeline.wait_stream_end(request_id, timeout_s=120)
        assert events[-1].type == "done", events[-1]
        assert not any(isinstance(e, RestartEvent) for e in events), "continued, not started over"
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[-1].usage.completion_tokens == N * MAX_TOKENS
        for index in range(N):
            tokens = _choice_tokens(events, index)
            ids = [t for e in tokens for t in e.token_ids]
            assert len(ids) == MAX_TOKENS and tokens[-1].finish_reason == "length"
            text = "".join(e.text for e in tokens)
            before = "".join(e.text for e in _choice_tokens(delivered[request_id], index))
            assert text.startswith(before) and text == expected_text(llm, PROMPT, ids)
        assert pipeline.record(request_id).worker_id != owner

    sse.join(timeout=60)
    assert sse.error is None, sse.error
    assert sse.texts == [reference] * N, "every greedy choice equals the uninterrupted run"
    assert sse.finish == ["length"] * N and sse.usage.completion_tokens == N * MAX_TOKENS
    sampled_texts = {"".join(e.text for e in _choice_tokens(pipeline.stream_events(rid), i)) for i in range(N)}
    assert len(sampled_texts) == N, "sampled choices differ"
