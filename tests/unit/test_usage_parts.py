"""The usage ledger and token quotas without a backbone: periods and reset times, which quotas a request is
checked against and what it costs, the ledger record of each way a request ends, the refusal's OpenAI shape,
the report's hour window, the keys file's quota fields, and the ``sluicegate usage`` command's parsing and table."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

import pytest

from cli.main import build_parser
from cli.tools.usage import parse_time, render
from ingress.auth import parse_keys_file
from schemas import InferenceRequest, SamplingOptions, Usage, UsageRecord
from sluicegate.api.limits import Limits
from sluicegate.settings import Settings
from sluicegate.usage.ledger import outcome_of, usage_record
from sluicegate.usage.quota import QuotaLimit, QuotaRefusal, claim_for, period_end, period_label, tenant_quotas
from sluicegate.usage.report import hour_window

NOW = datetime(2025, 12, 31, 23, 59, 30, tzinfo=UTC)


def _request(**extra: object) -> InferenceRequest:
    fields: dict[str, object] = {"request_id": "r1", "model": "m", "prompt": [1, 2, 3], "tenant": "acme"}
    return InferenceRequest.model_validate(fields | extra)


def test_periods_are_utc_days_and_months_and_roll_over_the_year() -> None:
    assert period_label("day", NOW) == "d20251231"
    assert period_label("month", NOW) == "m202512"
    assert period_end("day", NOW) == datetime(2026, 1, 1, tzinfo=UTC)
    assert period_end("month", NOW) == datetime(2026, 1, 1, tzinfo=UTC)
    assert period_end("month", datetime(2025, 2, 10, 5, tzinfo=UTC)) == datetime(2025, 3, 1, tzinfo=UTC)


def test_claim_names_the_key_and_tenant_quotas_in_force_and_costs_prompt_plus_n_max_tokens() -> None:
    settings = Settings(tenant_tokens_per_month=1000, tenant_quotas={"acme": {"tokens_per_day": 50}})
    assert tenant_quotas(settings, "acme") == (50, 1000)
    assert tenant_quotas(settings, "other") == (0, 1000)
    request = _request(sampling=SamplingOptions(max_tokens=10, n=2))
    claim = claim_for(request, settings, key_id="k1", key_limits=Limits(tokens_per_day=30))
    assert claim is not None and claim.cost == 3 + 2 * 10
    assert {(q.scope, q.period, q.tokens) for q in claim.limits} == {
        ("key", "day", 30),
        ("tenant", "day", 50),
        ("tenant", "month", 1000),
    }
    # An exact count of the prompt replaces the estimate; no quota in force means no claim at all.
    assert claim_for(request, settings, prompt_tokens=9).cost == 9 + 20  # type: ignore[union-attr]
    assert claim_for(request, Settings()) is None
    text = _request(prompt="x" * 40, sampling=SamplingOptions(max_tokens=1))
    assert claim_for(text, Settings(tenant_tokens_per_day=5)).cost == 10 + 1  # type: ignore[union-attr]


def test_refusal_is_openai_insufficient_quota_with_the_reset_time() -> None:
    refusal = QuotaRefusal(QuotaLimit("key", "k1", "day", 100), used=95, cost=8, resets_at=period_end("day", NOW))
    error = refusal.error(NOW)
    assert error.status == 429
    assert error.body()["error"]["code"] == error.body()["error"]["type"] == "insufficient_quota"
    assert error.headers == {"Retry-After": "30", "X-Quota-Reset": "2026-01-01T00:00:00Z", "x-should-retry": "false"}
    assert "daily token quota of this API key (100 tokens per UTC day) has 5 left" in error.message
    assert "resets at 2026-01-01T00:00:00Z (in 30 s)" in error.message


@pytest.mark.parametrize(
    ("reason", "outcome"), [("stop", "finished"), ("length", "finished"), ("abort", "cancelled"), ("error", "failed")]
)
def test_outcome_of_finish_reason(reason: str, outcome: str) -> None:
    assert outcome_of(reason) == outcome  # type: ignore[arg-type]


def test_usage_records_of_a_finished_a_cached_and_a_failed_request() -> None:
    request = _request(key_id="abc", priority="interactive", created_at=NOW)
    usage = Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10, cached_tokens=2)
    taken, end = NOW.timestamp() + 1.5, datetime.fromtimestamp(NOW.timestamp() + 2, UTC)
    record = usage_record(request, producer="w", usage=usage, finish_reason="length", started_at=taken, finished_at=end)
    assert (record.outcome, record.tier, record.key_id, record.total_tokens, record.cached_tokens) == (
        "finished",
        "interactive",
        "abc",
        10,
        2,
    )
    assert record.queue_s == pytest.approx(1.5) and record.ttft_s is None and record.duration_s == 2.0
    cached = usage_record(request, producer="response-cache", usage=usage.model_copy(update={"cached": True}),
                          finish_reason="stop")  # fmt: skip
    assert cached.response_cache and cached.outcome == "finished"
    failed = usage_record(request, producer="w1", usage=None, finish_reason=None, error_code="invalid_request")
    assert (failed.outcome, failed.finish_reason, failed.total_tokens, failed.error_code) == (
        "failed",
        "error",
        0,
        "invalid_request",
    )
    assert UsageRecord.model_validate_json(failed.model_dump_json()) == failed


def test_report_window_is_widened_to_whole_hours() -> None:
    assert hour_window(7200, 10_800) == (2, 2)
    assert hour_window(7201, 10_801) == (2, 3)
    assert hour_window(7300, 7301) == (2, 2)


def test_keys_file_sets_a_keys_token_quotas() -> None:
    line = '{"key": "sk-quota-1234", "tenant": "acme", "tokens_per_day": 10, "tokens_per_month": 99}'
    (key,) = parse_keys_file([line])
    limits = key.limits.resolve(Settings(limit_tokens_per_month=5))
    assert (limits.tokens_per_day, limits.tokens_per_month) == (10, 99)
    assert Limits().tokens_per_day == 0 and key.limits.resolve(Settings()).tokens_per_month == 99


def test_usage_command_parses_times_and_renders_a_table() -> None:
    assert parse_time("1700000000") == 1_700_000_000
    assert parse_time("2025-01-01") == int(datetime(2025, 1, 1, tzinfo=UTC).timestamp())
    assert parse_time("2025-01-01T01:00:00Z") == int(datetime(2025, 1, 1, 1, tzinfo=UTC).timestamp())
    with pytest.raises(argparse.ArgumentTypeError):
        parse_time("yesterday")
    args = build_parser().parse_args(["usage", "--group-by", "key", "--start", "2025-01-01", "--json"])
    assert (args.group_by, args.json, args.start) == ("key", True, parse_time("2025-01-01"))
    row = {"requests": 2, "total_tokens": 30, "prompt_tokens": 10, "output_tokens": 20}
    report = {"tenant": "acme", "start": 0, "end": 3600, "group_by": "key", "data": [{"key_id": None, **row}],
              "totals": row}  # fmt: skip
    table = render(report).splitlines()
    assert table[0] == "usage of tenant acme, 1970-01-01 00:00 UTC to 1970-01-01 01:00 UTC"
    assert table[1].split()[:3] == ["key", "id", "requests"]
    assert table[2].split()[:3] == ["(no", "key)", "2"] and table[3].split()[:2] == ["total", "2"]
