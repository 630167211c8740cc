"""A request's deadline as clients give it: seconds from now or an RFC 3339 time with a zone, in the ``deadline``
body field of every endpoint or the ``X-Request-Deadline`` header; anything else refused naming the field; a
batch line's deadline is its window's end, so a line that gives one is an error line."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from batch_service.prepare import LineOutcome, build_line
from ingress.accept import _with_header_deadline
from schemas import utcnow
from sluicegate.api.bodies import ChatCompletionBody, CompletionBody, NativeRequestBody
from sluicegate.api.build import build_request
from sluicegate.api.deadlines import MAX_DEADLINE_S, parse_deadline
from sluicegate.api.errors import ApiError, invalid
from sluicegate.api.limits import Limits

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (30, 30.0),
        (2.5, 2.5),
        ("30", 30.0),
        (" 0.25 ", 0.25),
        ("2026-11-26T16:00:00Z", datetime(2026, 11, 26, 16, tzinfo=UTC)),
        ("2026-11-26T17:30:00+01:00", datetime(2026, 11, 26, 16, 30, tzinfo=UTC)),
        ("2026-11-26t16:00:00.5z", datetime(2026, 11, 26, 16, 0, 0, 500000, tzinfo=UTC)),
    ],
)
def test_seconds_or_an_rfc3339_time_are_deadlines(given: Any, expected: datetime | float) -> None:
    assert parse_deadline(given) == expected


@pytest.mark.parametrize(
    "given",
    [
        "soon",
        "",
        "2026-11-26T16:00:00",  # no zone
        "2026-11-26",  # a date is not a time
        True,
        0,
        -5,
        "-1",
        "nan",
        "inf",
        MAX_DEADLINE_S + 1,
        [30],
        None,
        datetime(2026, 11, 26, 16),
    ],
)
def test_anything_else_is_refused(given: Any) -> None:
    with pytest.raises(ValueError, match="deadline"):
        parse_deadline(given)


@pytest.mark.parametrize("model", [ChatCompletionBody, CompletionBody, NativeRequestBody])
def test_every_endpoint_takes_the_body_field(model: Any) -> None:
    body = dict(CHAT) if model is ChatCompletionBody else {"model": "m", "prompt": "hi"}
    now = utcnow()
    parsed = model.model_validate({**body, "deadline": 12})
    request = build_request(parsed, request_id="r", tenant="t", tier="standard", trace=None, now=now)
    assert request.deadline == now + timedelta(seconds=12)
    when = (now + timedelta(minutes=5)).astimezone(timezone(timedelta(hours=2))).isoformat()
    parsed = model.model_validate({**body, "deadline": when})
    assert build_request(parsed, request_id="r", tenant="t", tier="standard", trace=None, now=now).deadline == (
        now + timedelta(minutes=5)
    )


def test_a_bad_body_field_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionBody.model_validate({**CHAT, "deadline": "tomorrow"})
    error = invalid(info.value, root_field="messages")
    assert error.status == 400 and error.body()["error"]["param"] == "deadline"
    assert "RFC 3339" in error.message


def test_the_header_applies_when_the_body_gives_none() -> None:
    body = ChatCompletionBody.model_validate(CHAT)
    assert _with_header_deadline(body, None).deadline is None
    assert _with_header_deadline(body, "45").deadline == 45.0
    assert _with_header_deadline(body, "2030-01-01T00:00:00Z").deadline == datetime(2030, 1, 1, tzinfo=UTC)
    own = ChatCompletionBody.model_validate({**CHAT, "deadline": 7})
    assert _with_header_deadline(own, "45").deadline == 7.0  # the body's field wins


def test_a_bad_header_is_a_400_naming_it() -> None:
    with pytest.raises(ApiError) as info:
        _with_header_deadline(ChatCompletionBody.model_validate(CHAT), "next tuesday")
    assert info.value.status == 400
    payload = info.value.body()["error"]
    assert payload["param"] == "X-Request-Deadline" and payload["code"] == "invalid_value"
    assert "X-Request-Deadline" in payload["message"]


def test_a_batch_line_takes_the_window_end_and_may_not_give_its_own() -> None:
    window_end = utcnow() + timedelta(hours=24)
    common: dict[str, Any] = dict(
        endpoint="/v1/chat/completions", request_id="b-L0", tenant="t", limits=Limits(), known_models=None
    )
    built = build_line(dict(CHAT), deadline=window_end, **common)
    assert not isinstance(built, LineOutcome) and built.request.deadline == window_end
    refused = build_line({**CHAT, "deadline": 5}, deadline=window_end, **common)
    assert isinstance(refused, LineOutcome) and refused.param == "deadline" and refused.status_code == 400
