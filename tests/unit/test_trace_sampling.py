"""The tracing sampler: request roots kept at the configured ratio, background client spans never rooted."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import SpanKind

from sluicegate.telemetry import _RequestRootsOnly, root_sample_ratio


@pytest.mark.parametrize(
    ("sampler", "arg", "expected"),
    [
        (None, None, 1.0),
        ("parentbased_always_on", None, 1.0),
        ("always_off", None, 0.0),
        ("parentbased_traceidratio", "0.25", 0.25),
        ("traceidratio", None, 1.0),
    ],
)
def test_ratio_from_the_standard_variables(
    monkeypatch: pytest.MonkeyPatch, sampler: str | None, arg: str | None, expected: float
) -> None:
    for name, value in (("OTEL_TRACES_SAMPLER", sampler), ("OTEL_TRACES_SAMPLER_ARG", arg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert root_sample_ratio() == expected


@pytest.mark.parametrize("arg", ["half", "1.5", "-0.1"])
def test_a_bad_ratio_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, arg: str) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
        root_sample_ratio()


def _kept(sampler: _RequestRootsOnly, kind: SpanKind, trace_ids: range) -> int:
    return sum(
        sampler.should_sample(None, trace_id, "x", kind).decision is Decision.RECORD_AND_SAMPLE
        for trace_id in trace_ids
    )


def test_roots_kept_at_the_ratio_and_client_spans_never() -> None:
    # Trace ids spread evenly over the 64 bits the ratio sampler reads.
    ids = range(1, 2**64, 2**64 // 4000)
    assert _kept(_RequestRootsOnly(), SpanKind.SERVER, ids) == len(ids)
    assert _kept(_RequestRootsOnly(), SpanKind.CLIENT, ids) == 0
    quarter = _kept(_RequestRootsOnly(0.25), SpanKind.SERVER, ids)
    assert abs(quarter / len(ids) - 0.25) < 0.02
    assert _kept(_RequestRootsOnly(0.25), SpanKind.PRODUCER, ids) == 0
    assert _kept(_RequestRootsOnly(0.0), SpanKind.INTERNAL, ids) == 0
