"""Routes as data: the routing file's validation, the weighted sticky split (rendezvous hashing), the fast
path, and canary verdicts."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from router.canary import CanaryJudge, Outcome
from router.routes import RoutesError, parse_routes
from router.versions import choose_version, rendezvous

GOOD = """
routes:
  chat:
    sticky: user
    targets:
      - {model: v1, weight: 90}
      - {model: v2, weight: 10, canary: true}
    canary: {window_s: 60, min_requests: 10, error_rate_margin: 0.1, ttft_p99_margin: 0.5}
"""


def test_a_valid_file_parses() -> None:
    spec = parse_routes(GOOD).routes["chat"]
    assert spec.versions == ["v1", "v2"] and spec.sticky == "user" and spec.canary is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("routes: {chat: {targets: []}}", "at least 1 item"),
        ("routes: {chat: {targets: [{model: a, weight: 0}]}}", "add up to 0"),
        ("routes: {chat: {targets: [{model: a, weight: 1}, {model: a, weight: 2}]}}", "listed twice"),
        ("routes: {chat: {targets: [{model: a, weight: 1, canary: true}]}}", "stable version"),
        ("routes: {chat: {targets: [{model: a, weight: 1}], canary: {}}}", "canary: true"),
        ("routes: {chat: {targets: [{model: a, weight: -1}]}}", "greater than or equal to 0"),
        ("routes: {chat: {targets: [{model: a, weight: 1}], stiky: user}}", "stiky"),
        ("routes: {a: {targets: [{model: b, weight: 1}]}, b: {targets: [{model: c, weight: 1}]}}", "do not nest"),
        ("routes: [", "not valid YAML"),
    ],
)
def test_bad_files_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(RoutesError, match=message):
        parse_routes(text, source="r.yaml")


def test_the_split_follows_the_weights_within_statistical_bounds() -> None:
    n, share = 20_000, 0.1
    counts = Counter(rendezvous("chat", f"user-{i}", {"v1": 90, "v2": 10}) for i in range(n))
    # Binomial: 4.5 standard deviations either side fails by chance about once in 150,000 runs.
    bound = 4.5 * math.sqrt(n * share * (1 - share))
    assert abs(counts["v2"] - n * share) < bound, counts


def test_a_key_sticks_and_only_the_rolled_back_versions_keys_move() -> None:
    keys = [f"t{i}" for i in range(2000)]
    before = {k: rendezvous("chat", k, {"v1": 50, "v2": 30, "v3": 20}) for k in keys}
    assert before == {k: rendezvous("chat", k, {"v1": 50, "v2": 30, "v3": 20}) for k in keys}
    after = {k: rendezvous("chat", k, {"v1": 50, "v2": 30, "v3": 0}) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "v3"} and moved
    with pytest.raises(ValueError, match="no version"):
        rendezvous("chat", "k", {"v1": 0})


def test_the_fast_path_takes_short_prompts_only() -> None:
    spec = parse_routes(
        "routes: {chat: {targets: [{model: big, weight: 1}], fast_path: {model: small, max_prompt_tokens: 8, "
        "tokenizer: /x}}}"
    ).routes["chat"]

    def pick(tokens: int | None) -> str:
        choice = choose_version("chat", spec, sticky_key="t", weights={"big": 1}, prompt_tokens=lambda _: tokens)
        return f"{choice.version}/{choice.reason}"

    assert pick(7) == "small/fast_path"
    assert pick(8) == "big/split"
    assert pick(None) == "big/split"


def _judge_with(canary_ok: float, canary_ttft: float, n: int = 20) -> list[str]:
    spec = parse_routes(GOOD).routes["chat"]
    judge = CanaryJudge()
    for i in range(n):
        judge.record("chat", "v1", Outcome(100.0 + i, True, 0.1))
        judge.record("chat", "v2", Outcome(100.0 + i, i < canary_ok * n, canary_ttft))
    return [f"{v.version}:{v.cause}" for v in judge.verdicts("chat", spec, {"v1": 90, "v2": 10}, now=130.0)]


def test_a_canary_failing_more_than_the_margin_is_rolled_back() -> None:
    assert _judge_with(canary_ok=0.5, canary_ttft=0.1) == ["v2:error_rate"]


def test_a_canary_whose_ttft_p99_is_too_slow_is_rolled_back() -> None:
    assert _judge_with(canary_ok=1.0, canary_ttft=0.2) == ["v2:ttft_p99"]


def test_a_canary_within_the_margins_stays() -> None:
    assert _judge_with(canary_ok=0.95, canary_ttft=0.14) == []


def test_no_verdict_before_enough_requests_or_outside_the_window() -> None:
    assert _judge_with(canary_ok=0.0, canary_ttft=0.1, n=5) == []
    spec = parse_routes(GOOD).routes["chat"]
    judge = CanaryJudge()
    for i in range(20):
        judge.record("chat", "v2", Outcome(float(i), False, None))
    assert judge.verdicts("chat", spec, {"v1": 90, "v2": 10}, now=1000.0) == []
