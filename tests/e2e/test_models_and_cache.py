"""Several models at once, routes and the response cache, end to end: two real tiny random-weight models of
different sizes, each served by its own worker group, a routing file (weighted sticky split, fast path, a canary
on a version that never answers), and the official ``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from schemas import Names

from .conftest import API_KEY, MODEL_NAME, Pipeline
from .test_pipeline_native import read_ws

OTHER_KEY = "sk-e2e-other-tenant"
BIG_MODEL = "tiny-e2e-big"


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("models") / BIG_MODEL, arch="llama", num_layers=3, hidden_size=128, seed=1
    )


BROKEN = "broken-version"  # served (ingress accepts it) but no worker ever answers: the injected failure
FAST_LIMIT = 12


def routes_yaml(tokenizer_dir: Path, *, ab: tuple[int, int] = (50, 50)) -> str:
    return f"""
routes:
  ab:
    sticky: user
    targets:
      - {{model: {MODEL_NAME}, weight: {ab[0]}}}
      - {{model: {BIG_MODEL}, weight: {ab[1]}}}
  fast:
    targets: [{{model: {BIG_MODEL}, weight: 1}}]
    fast_path: {{model: {MODEL_NAME}, max_prompt_tokens: {FAST_LIMIT}, tokenizer: {tokenizer_dir}}}
  canary:
    sticky: none
    targets:
      - {{model: {MODEL_NAME}, weight: 50}}
      - {{model: {BROKEN}, weight: 50, canary: true}}
    canary: {{window_s: 300, min_requests: 4, error_rate_margin: 0.2, first_token_timeout_s: 2}}
"""


@pytest.fixture(scope="module")
def routes_file(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("routes") / "routes.yaml"
    path.write_text(routes_yaml(tiny_model_dir))
    return path


@pytest.fixture(scope="module")
def pipeline_env(routes_file: Path) -> dict[str, str]:
    return {
        "SLUICEGATE_API_KEYS": f"{API_KEY},{OTHER_KEY}",
        "SLUICEGATE_RESPONSE_CACHE_TTL_S": "120",
        "SLUICEGATE_ROUTES_FILE": str(routes_file),
        "SLUICEGATE_ROUTES_RELOAD_S": "0.2",
        "SLUICEGATE_SERVED_MODELS": BROKEN,
    }


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
    pipeline.start_worker(
        "worker-big",
        SLUICEGATE_MODEL=str(big_model_dir),
        SLUICEGATE_MODEL_NAME=BIG_MODEL,
        SLUICEGATE_MODEL_DESCRIPTION="random weights",  # as sluicegate up says of its fallback model
    )
    wait_model(pipeline, BIG_MODEL)
    return pipeline


def test_models_lists_each_model_and_an_unknown_one_is_a_404(two_models: Pipeline) -> None:
    client = two_models.openai()
    # The two versions, and the routed public names that have a live version.
    cards = {m.id: m for m in client.models.list()}
    assert {MODEL_NAME, BIG_MODEL, "ab", "fast", "canary"} <= set(cards)
    # What a worker says of its model comes through its heartbeats.
    assert getattr(cards[BIG_MODEL], "description", None) == "random weights"
    assert getattr(cards[MODEL_NAME], "description", None) is None
    assert client.models.retrieve("ab").id == "ab"
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
    # A WebSocket client of the result service gets the hit as it gets any reply.
    relayed, _ = asyncio.run(read_ws(f"{second['stream_url']}?token={second['stream_token']}"))
    assert "".join(e.get("text", "") for e in relayed) == "".join(getattr(e, "text", "") for e in original)
    assert relayed[-1]["type"] == "done" and relayed[-1]["usage"]["cached"] is True


def _other_client(pipeline: Pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=OTHER_KEY)


# --- routes ---------------------------------------------------------------------------------------------
def _ask(client: openai.OpenAI, model: str, content: str = "hello", **extra: Any) -> str:
    """The version that answered (the response's ``model``)."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=1, **extra
    )
    return reply.model


def test_the_ab_split_follows_the_weights_and_sticks_per_user(two_models: Pipeline) -> None:
    from router.versions import rendezvous

    client = two_models.openai()
    weights = {MODEL_NAME: 50.0, BIG_MODEL: 50.0}
    users = [f"user-{i}" for i in range(40)]
    got = {user: _ask(client, "ab", user=user) for user in users}
    # Each user lands where the consistent hash puts them (so the split is the hash's, checked for ratio in
    # the unit tests), and the ratio here is within 4.5 standard deviations of 50/50 (binomial, n=40).
    assert got == {user: rendezvous("ab", f"user:{user}", weights) for user in users}
    small = sum(v == MODEL_NAME for v in got.values())
    assert abs(small - 20) < 4.5 * math.sqrt(40 * 0.25), got
    # Sticky: a user's later turns stay on their version.
    for user in users[:5]:
        assert {_ask(client, "ab", f"turn {n}", user=user) for n in range(3)} == {got[user]}
    metrics = httpx.get(f"{two_models.ingress_url}/metrics", timeout=5).text
    assert f'sluicegate_ingress_routed_total{{reason="split",route="ab",version="{BIG_MODEL}"}}' in metrics


def test_short_prompts_take_the_fast_path_unless_a_version_is_pinned(two_models: Pipeline) -> None:
    client = two_models.openai()
    assert _ask(client, "fast", "hi") == MODEL_NAME
    long_prompt = " ".join(f"word{i}" for i in range(60))
    assert _ask(client, "fast", long_prompt) == BIG_MODEL
    # Naming the version itself pins it: no routing, short prompt or not.
    assert _ask(client, BIG_MODEL, "hi") == BIG_MODEL


def _metric(pipeline: Pipeline, line_start: str) -> float | None:
    for line in httpx.get(f"{pipeline.ingress_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def roll_back_canary(pipeline: Pipeline) -> int:
    """Send ``canary`` requests through ingress until it rolls the never-answering canary back; returns how many
    went to the canary."""
    client = pipeline.openai(max_retries=0)
    to_canary = 0
    rollback = f'sluicegate_ingress_canary_rollbacks_total{{cause="error_rate",route="canary",version="{BROKEN}"}}'
    deadline = time.monotonic() + 90
    while not _metric(pipeline, rollback):
        assert time.monotonic() < deadline, "the canary was never rolled back:\n" + pipeline.find("ingress").log()
        if to_canary < 6:
            stream = client.chat.completions.create(
                model="canary", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
            )
            first = next(iter(stream))  # the opening chunk names the version at once, even one that hangs
            to_canary += first.model == BROKEN
            stream.close()  # leave a hanging request (ingress cancels it); the watch still judges it
        time.sleep(0.2)
    return to_canary


def test_a_failing_canary_is_rolled_back_to_zero(two_models: Pipeline) -> None:
    client = two_models.openai(max_retries=0)
    assert roll_back_canary(two_models) >= 4
    assert _metric(two_models, f'sluicegate_ingress_route_weight{{route="canary",version="{BROKEN}"}}') == 0
    assert (
        "ingress.canary_rolled_back route=canary version=broken-version cause=error_rate"
        in two_models.find("ingress").log()
    )
    # After the rollback every request goes to the stable version.
    assert {_ask(client, "canary", f"after {n}") for n in range(8)} == {MODEL_NAME}


def test_the_routing_file_reloads_on_change_and_a_bad_change_is_refused(
    two_models: Pipeline, routes_file: Path, tiny_model_dir: Path
) -> None:
    client = two_models.openai()
    original = routes_file.read_text()
    try:
        routes_file.write_text(routes_yaml(tiny_model_dir, ab=(0, 100)))
        deadline = time.monotonic() + 15
        while {_ask(client, "ab", user=f"reload-{n}") for n in range(6)} != {BIG_MODEL}:
            assert time.monotonic() < deadline, "the changed routing file was not picked up"
            time.sleep(0.3)
        routes_file.write_text("routes: {ab: {targets: []}}")
        deadline = time.monotonic() + 15
        while not _metric(two_models, "sluicegate_ingress_routes_reload_failures_total"):
            assert time.monotonic() < deadline, "the bad routing file was not noticed"
            time.sleep(0.2)
        assert {_ask(client, "ab", user=f"kept-{n}") for n in range(6)} == {BIG_MODEL}  # the last good routes
    finally:
        routes_file.write_text(original)
