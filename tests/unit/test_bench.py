"""``sluicegate bench``'s arithmetic: quantiles, SLO checks, goodput, workloads and flag parsing (no server)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cli.bench.measure import BenchError, Sample, Slo, load_prompts, parse_levels, quantile, summarize
from cli.bench.sweep import _finite


def test_quantile_interpolates_and_orders() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([5.0], 0.99) == 5.0 and math.isnan(quantile([], 0.5))


def test_summary_goodput_and_ordered_percentiles() -> None:
    fast = Sample(sent=0, ttft=0.01, itls=[0.002] * 3, e2e=0.02, prompt_tokens=5, output_tokens=4)
    slow = Sample(sent=0, ttft=0.5, itls=[0.1] * 3, e2e=0.8, prompt_tokens=5, output_tokens=4)
    failed = Sample(error="500 boom")
    run = summarize([fast, slow, failed], 2.0, Slo(ttft_ms=100), label="x")
    assert (run["requests"], run["completed"], run["failed"], run["good_requests"]) == (3, 2, 1, 1)
    assert run["goodput"] == 0.5 and run["output_throughput"] == 4.0
    assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] and run["errors"] == {"500 boom": 1}
    assert summarize([fast], 1.0, Slo(ttft_ms=0.001))["goodput"] == 0
    assert not Slo(ttft_ms=1e9).met(Sample(e2e=1.0))  # no TTFT seen (not streamed): a TTFT objective fails


def test_workloads_and_flags(tmp_path: Path) -> None:
    shipped = load_prompts(150, dataset=None, input_len=None, output_len=7)
    assert len(shipped) == 150 and len({p.text for p in shipped}) >= 100 and shipped[0].max_tokens == 7
    synthetic = load_prompts(2, dataset=None, input_len=12, output_len=3)
    assert all(len(p.text.split()) == 12 for p in synthetic)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(BenchError, match="line 1"):
        load_prompts(1, dataset=bad, input_len=None, output_len=1)
    assert parse_levels("1,8,32", "--concurrency", integer=True) == [1, 8, 32]
    assert parse_levels("inf", "--rate", integer=False) == [math.inf]
    with pytest.raises(BenchError, match="--rate"):
        parse_levels("fast", "--rate", integer=False)


def test_a_reply_with_no_content_was_first_answered_by_its_end() -> None:
    """An instruct model may answer a raw prompt with its end-of-text token alone: no content, one output token.
    Its TTFT is its end (vLLM counts the first chunk with a choice), so a TTFT objective is judged on it."""
    empty = Sample(sent=1.0, output_tokens=1)
    empty.ended(1.2)
    assert empty.ok and empty.ttft == pytest.approx(0.2) and empty.e2e == pytest.approx(0.2)
    assert Slo(ttft_ms=10_000).met(empty)
    streamed = Sample(sent=0.0)
    streamed.content_at(0.1)
    streamed.ended(0.5)
    assert streamed.ttft == pytest.approx(0.1)  # content came first: its TTFT stands


def test_the_report_is_json_other_parsers_read() -> None:
    """``--rate inf`` is written as vLLM's bench writes it; NaN (an empty distribution) as null; never Infinity."""
    report = {"runs": [{"rate": math.inf, "x": [1.0, math.nan, -math.inf]}], "n": 2}
    assert _finite(report) == {"runs": [{"rate": "inf", "x": [1.0, None, "-inf"]}], "n": 2}

    with pytest.raises(BenchError, match="got ''"):  # an empty list is a mistake, not the default level
        parse_levels("", "--concurrency", integer=True)
