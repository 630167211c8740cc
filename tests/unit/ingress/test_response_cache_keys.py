"""Which requests the response cache may answer, and what its key covers (every sampling parameter, the
tenant unless shared)."""

from __future__ import annotations

import json

import pytest

from ingress.response_cache import _renumbered, cache_directives, deterministic, request_digest
from schemas import DoneEvent, InferenceRequest, SamplingOptions, TokenEvent, Usage


def _request(tenant: str = "t1", **sampling: object) -> InferenceRequest:
    return InferenceRequest(
        request_id="r1", model="m", prompt="hello", tenant=tenant, sampling=SamplingOptions(**sampling)
    )


def test_only_greedy_or_seeded_requests_are_deterministic() -> None:
    assert deterministic(_request(temperature=0.0))
    assert deterministic(_request(temperature=0.8, seed=7))
    assert not deterministic(_request(temperature=0.8))


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, (True, True)),
        ("no-cache", (False, True)),
        ("No-Store, max-age=0", (False, False)),
        ("max-age=5", (True, True)),
    ],
)
def test_cache_control(header: str | None, expected: tuple[bool, bool]) -> None:
    assert cache_directives(header) == expected


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 9},
        {"top_p": 0.5},
        {"top_k": 3},
        {"stop": ["x"]},
        {"seed": 1},
        {"logprobs": 2},
        {"n": 2},
        {"repetition_penalty": 1.1},
        {"min_p": 0.1},
        {"logit_bias": {"5": 1.0}},
        {"ignore_eos": True},
    ],
)
def test_every_sampling_parameter_changes_the_key(change: dict[str, object]) -> None:
    base = request_digest(_request(temperature=0.0), shared=False)
    assert request_digest(_request(temperature=0.0, **change), shared=False) != base


def test_tenants_have_their_own_keys_unless_shared() -> None:
    a, b = _request("a", temperature=0.0), _request("b", temperature=0.0)
    assert request_digest(a, shared=False) != request_digest(b, shared=False)
    assert request_digest(a, shared=True) == request_digest(b, shared=True)


def test_a_replayed_entry_becomes_the_new_requests_and_says_cached() -> None:
    usage = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3)
    stored = [
        TokenEvent(request_id="old", seq=0, text="hi", token_ids=[5]),
        DoneEvent(request_id="old", seq=1, finish_reason="stop", usage=usage),
    ]
    events = _renumbered(json.dumps([e.model_dump(mode="json") for e in stored]), "new")
    assert events is not None and [e.request_id for e in events] == ["new", "new"]
    assert isinstance(events[1], DoneEvent) and events[1].usage.cached
    assert events[0].model_dump_json() == stored[0].model_copy(update={"request_id": "new"}).model_dump_json()
    assert "cached" not in usage.model_dump()  # a worker's usage reads as before


def test_a_damaged_entry_is_a_miss() -> None:
    assert _renumbered('[{"type": "token"}]', "new") is None
    assert _renumbered("not json", "new") is None
