"""Stream tokens open exactly the request and tenant they were issued for, until the expiry signed into them."""

import hashlib
import hmac

import pytest

from sluicegate.settings import Settings
from sluicegate.stream_tokens import ExpiredStreamToken, InvalidStreamToken, issue_stream_token, verify_stream_token

NOW = 1_800_000_000.0
HOUR = 3600


def issue(request_id: str = "req-1", tenant: str = "acme", secret: str = "s3cret") -> str:
    """A token issued at ``NOW`` for an hour."""
    return issue_stream_token(secret, request_id, tenant, lifetime_s=HOUR, now=NOW)


def test_token_opens_its_own_stream_only() -> None:
    token = issue()
    assert verify_stream_token("s3cret", "req-1", token, now=NOW) == "acme"
    with pytest.raises(InvalidStreamToken, match="invalid stream token"):
        verify_stream_token("s3cret", "req-2", token, now=NOW)
    with pytest.raises(InvalidStreamToken, match="invalid stream token"):
        verify_stream_token("other", "req-1", token, now=NOW)


def test_a_tenant_with_dots_round_trips() -> None:
    assert verify_stream_token("s3cret", "req-1", issue(tenant="acme.eu.1"), now=NOW) == "acme.eu.1"


def test_the_expiry_is_carried_in_the_token_and_enforced() -> None:
    token = issue()
    assert token.split(".")[1] == str(int(NOW) + HOUR)
    assert verify_stream_token("s3cret", "req-1", token, now=NOW + HOUR - 1) == "acme"
    with pytest.raises(ExpiredStreamToken, match="stream token expired at 2027-01-15T09:00:00Z") as exc:
        verify_stream_token("s3cret", "req-1", token, now=NOW + HOUR)
    assert exc.value.expires_at == int(NOW) + HOUR


def test_a_moved_expiry_breaks_the_mac() -> None:
    tenant, expiry, mac = issue().split(".")
    later = f"{tenant}.{int(expiry) + 10 * HOUR}.{mac}"
    with pytest.raises(InvalidStreamToken) as exc:
        verify_stream_token("s3cret", "req-1", later, now=NOW + 2 * HOUR)
    assert not isinstance(exc.value, ExpiredStreamToken)


def test_a_forged_expired_token_says_invalid_not_expired() -> None:
    with pytest.raises(InvalidStreamToken) as exc:
        verify_stream_token("s3cret", "req-1", f"acme.{int(NOW) - 1}.{'0' * 64}", now=NOW)
    assert not isinstance(exc.value, ExpiredStreamToken)


@pytest.mark.parametrize(
    "token",
    [
        "evil.{expiry}.{mac}",
        "acme.{expiry}.{mac}0",
        "acme.x{expiry}.{mac}",
        "acme.-5.{mac}",
        "garbage",
        "acme.{mac}",
        "",
    ],
)
def test_tampered_or_malformed_tokens_are_refused(token: str) -> None:
    _, expiry, mac = issue().split(".")
    with pytest.raises(InvalidStreamToken, match="invalid stream token"):
        verify_stream_token("s3cret", "req-1", token.format(expiry=expiry, mac=mac), now=NOW)


def test_an_old_format_token_is_refused_cleanly() -> None:
    """Tokens issued before expiries (``<tenant>.<HMAC of "<id>\\n<tenant>">``) are refused as invalid."""
    old_mac = hmac.new(b"s3cret", b"req-1\nacme", hashlib.sha256).hexdigest()
    with pytest.raises(InvalidStreamToken, match="invalid stream token"):
        verify_stream_token("s3cret", "req-1", f"acme.{old_mac}", now=NOW)
    # A dotted tenant in the old format looks like an expiry field; its MAC still cannot match.
    old_dotted = hmac.new(b"s3cret", b"req-1\nacme.17", hashlib.sha256).hexdigest()
    with pytest.raises(InvalidStreamToken, match="invalid stream token"):
        verify_stream_token("s3cret", "req-1", f"acme.17.{old_dotted}", now=0)


def test_empty_secret_and_non_positive_lifetime_are_errors() -> None:
    with pytest.raises(ValueError, match="SLUICEGATE_STREAM_TOKEN_SECRET"):
        issue_stream_token("", "r", "t", lifetime_s=HOUR)
    with pytest.raises(ValueError, match="lifetime"):
        issue_stream_token("s", "r", "t", lifetime_s=0)


def test_the_lifetime_is_the_request_life_plus_the_stream_retention() -> None:
    settings = Settings(request_record_ttl_s=86400, stream_ttl_s=3600)
    assert settings.stream_token_lifetime_s == 90000
