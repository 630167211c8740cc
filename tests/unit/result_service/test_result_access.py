"""Who may read a stream: request id, stream token, resume point."""

from __future__ import annotations

import pytest

from result_service.access import AccessDenied, BadStreamRequest, authorise
from sluicegate.stream_tokens import issue_stream_token

SECRET = "s3cret"


def test_a_valid_token_grants_the_tenant_and_the_latest_resume_point_wins() -> None:
    token = issue_stream_token(SECRET, "req-1", "acme", lifetime_s=3600)
    grant = authorise(SECRET, "req-1", token, "0-3", None, "0-8")
    assert (grant.request_id, grant.tenant, grant.after_seq) == ("req-1", "acme", 7)
    assert authorise(SECRET, "req-1", token).after_seq == -1


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, "missing stream token"),
        ("", "missing stream token"),
        (issue_stream_token(SECRET, "req-2", "acme", lifetime_s=3600), "invalid stream token"),  # another request's
        (issue_stream_token("other", "req-1", "acme", lifetime_s=3600), "invalid stream token"),  # another secret
        (issue_stream_token(SECRET, "req-1", "acme", lifetime_s=3600).replace("acme", "evil"), "invalid stream token"),
        ("garbage", "invalid stream token"),
    ],
    # Fixed ids: the signed tokens carry their issue time, and pytest-xdist refuses a run whose workers collected
    # differently named tests.
    ids=["none", "empty", "another-request", "another-secret", "another-tenant", "garbage"],
)
def test_bad_tokens_are_denied(token: str | None, message: str) -> None:
    with pytest.raises(AccessDenied, match=message):
        authorise(SECRET, "req-1", token)


def test_an_expired_token_is_denied_saying_it_expired() -> None:
    token = issue_stream_token(SECRET, "req-1", "acme", lifetime_s=60, now=1_000.0)
    assert authorise(SECRET, "req-1", token, now=1_059.0).tenant == "acme"
    with pytest.raises(AccessDenied, match="stream token expired at 1970-01-01T00:17:40Z"):
        authorise(SECRET, "req-1", token, now=1_060.0)


def test_malformed_request_id_and_last_id_are_bad_requests() -> None:
    with pytest.raises(BadStreamRequest, match="request id"):
        authorise(SECRET, "a b", issue_stream_token(SECRET, "a b", "acme", lifetime_s=3600))
    with pytest.raises(BadStreamRequest, match="last_id"):
        authorise(SECRET, "req-1", issue_stream_token(SECRET, "req-1", "acme", lifetime_s=3600), "12-0")
