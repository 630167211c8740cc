"""Several models at once and the response cache, end to end: two real tiny random-weight models of different
sizes, each served by its own worker group, and the official ``openai`` SDK as the client."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from schemas import Names

from .conftest import API_KEY, MODEL_NAME, Pipeline

OTHER_KEY = "sk-e2e-other-tenant"
BIG_MODEL = "tiny-e2e-big"


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("models") / BIG_MODEL, arch="llama", num_layers=3, hidden_size=128, seed=1
    )


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"SLUICEGATE_API_KEYS": f"{API_KEY},{OTHER_KEY}", "SLUICEGATE_RESPONSE_CACHE_TTL_S": "120"}


def wait_model(pipeline: Pipeline, name: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = httpx.get(f"{pipeline.ingress_url}/v1/models", headers=pipeline.headers(), timeout=5).json()
        if any(card["id"] == name for card in listed["data"]):
            return
        time.sleep(0.3)
    raise AssertionError(f"{name} never listed:\n" + "\n".join(s.log() for s in pipeline.services))


@pytest.fixture(scope="module")
def two_models(pipeline: Pipeline, big_model_dir: Path) -> Pipeline:
    """The module's pipeline plus a second worker group serving the bigger model."""
    pipeline.start_worker("worker-big", SLUICEGATE_MODEL=str(big_model_dir), SLUICEGATE_MODEL_NAME=BIG_MODEL)
    wait_model(pipeline, BIG_MODEL)
    return pipeline


def test_models_lists_each_model_and_an_unknown_one_is_a_404(two_models: Pipeline) -> None:
    client = two_models.openai()
    assert {MODEL_NAME, BIG_MODEL} <= {m.id for m in client.models.list()}
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert caught.value.body["param"] == "model"  # type: ignore[index]


def test_each_model_answers_from_its_own_workers(two_models: Pipeline) -> None:
    client = two_models.openai()
    replies = {
        name: client.completions.create(model=name, prompt="the river", max_tokens=8, temperature=0)
        for name in (MODEL_NAME, BIG_MODEL)
    }
    assert {name: reply.model for name, reply in replies.items()} == {MODEL_NAME: MODEL_NAME, BIG_MODEL: BIG_MODEL}
    # Different random weights: the two models do not write the same text.
    assert replies[MODEL_NAME].choices[0].text != replies[BIG_MODEL].choices[0].text


def _cached(usage: Any) -> bool:
    return bool(usage is not None and (usage.model_extra or {}).get("cached"))


def _entries(pipeline: Pipeline) -> int:
    """How many replies of the small model the cache holds."""
    pattern = f"{Names(pipeline.prefix).response_cache_key(MODEL_NAME, '')}*"
    return len(list(pipeline.redis().scan_iter(match=pattern)))


def _wait_stored(pipeline: Pipeline, before: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while _entries(pipeline) <= before:
        assert time.monotonic() < deadline, "the reply was never stored"
        time.sleep(0.05)


def test_a_repeated_greedy_request_is_served_from_the_cache_byte_for_byte(two_models: Pipeline) -> None:
    client = two_models.openai()
    ask: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "cache me, exactly"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    before = _entries(two_models)
    first = client.chat.completions.create(**ask)
    assert not _cached(first.usage)
    _wait_stored(two_models, before)
    again = client.chat.completions.create(**ask)
    assert _cached(again.usage)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].finish_reason == first.choices[0].finish_reason
    assert again.usage is not None and first.usage is not None
    assert again.usage.completion_tokens == first.usage.completion_tokens
    assert again.id != first.id  # a request of its own
    # The same hit as server-sent events: the same text, chunk by chunk, and the usage says cached.
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    assert _cached(chunks[-1].usage)
    # Cache-Control: no-cache goes to a worker (and still answers the same text: greedy).
    fresh = client.chat.completions.create(**ask, extra_headers={"Cache-Control": "no-cache"})
    assert not _cached(fresh.usage)
    assert fresh.choices[0].message.content == first.choices[0].message.content
    # Another tenant never gets this tenant's entry.
    theirs = _other_client(two_models).chat.completions.create(**ask)
    assert not _cached(theirs.usage)


def test_sampled_requests_are_never_cached(two_models: Pipeline) -> None:
    client = two_models.openai()
    ask: dict[str, Any] = {"model": MODEL_NAME, "prompt": "random walk", "max_tokens": 4, "temperature": 0.9}
    client.completions.create(**ask)
    assert not _cached(client.completions.create(**ask).usage)


def test_the_native_api_replays_a_hit_through_the_stream(two_models: Pipeline) -> None:
    body = {"prompt": "native repeat", "temperature": 0, "max_tokens": 6}
    before = _entries(two_models)
    first = two_models.submit(**body)
    original = two_models.wait_stream_end(first["request_id"])
    _wait_stored(two_models, before)
    second = two_models.submit(**body)
    replayed = two_models.wait_stream_end(second["request_id"], timeout_s=5)
    assert [e.model_dump(exclude={"request_id", "usage"}) for e in replayed] == [
        e.model_dump(exclude={"request_id", "usage"}) for e in original
    ]
    assert replayed[-1].usage.cached and not original[-1].usage.cached
    assert two_models.record(second["request_id"]).status == "finished"


def _other_client(pipeline: Pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=OTHER_KEY)
