"""Stream tokens open exactly the request and tenant they were issued for."""

import pytest

from sluicegate.stream_tokens import issue_stream_token, verify_stream_token


def test_token_opens_its_own_stream_only() -> None:
    token = issue_stream_token("s3cret", "req-1", "acme")
    assert verify_stream_token("s3cret", "req-1", token) == "acme"
    assert verify_stream_token("s3cret", "req-2", token) is None
    assert verify_stream_token("other", "req-1", token) is None


def test_tampered_tenant_or_mac_is_refused() -> None:
    token = issue_stream_token("s3cret", "req-1", "acme")
    mac = token.split(".", 1)[1]
    assert verify_stream_token("s3cret", "req-1", f"evil.{mac}") is None
    assert verify_stream_token("s3cret", "req-1", token[:-1] + ("0" if token[-1] != "0" else "1")) is None
    assert verify_stream_token("s3cret", "req-1", "garbage") is None


def test_empty_secret_is_an_error() -> None:
    with pytest.raises(ValueError, match="SLUICEGATE_STREAM_TOKEN_SECRET"):
        issue_stream_token("", "r", "t")
