"""Stream tokens: signed, expiring grants that let one client read one request's stream and nothing else.

Ingress issues a token bound to the request id and tenant, with an expiry fixed at issue: the request's longest
life (``SLUICEGATE_REQUEST_RECORD_TTL_S``: after it the pipeline keeps no record of the request) plus the stream's
retention once finished (``SLUICEGATE_STREAM_TTL_S``). The expiry travels inside the token and is covered by the
HMAC, so it cannot be moved. The result service checks it. Browsers cannot set WebSocket headers, so the token
travels as ``?token=``.

Format: ``<tenant>.<expiry, unix seconds>.<hex HMAC-SHA256 of "v2", request id, tenant and expiry>``. Tokens of
the earlier format (``<tenant>.<mac>``, no expiry) are refused as invalid.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import UTC, datetime

_VERSION = "v2"


class InvalidStreamToken(Exception):
    """The token does not open this request's stream (wrong request, tenant, secret, format or a tampered part)."""


class ExpiredStreamToken(InvalidStreamToken):
    """A genuine token for this request whose expiry has passed."""

    def __init__(self, expires_at: int) -> None:
        self.expires_at = expires_at
        when = datetime.fromtimestamp(expires_at, UTC).isoformat().replace("+00:00", "Z")
        super().__init__(
            f"stream token expired at {when}: a token lasts the request's life plus its stream's retention"
        )


def _mac(secret: str, request_id: str, tenant: str, expires_at: int) -> str:
    if not secret:
        raise ValueError("stream token secret is empty: set SLUICEGATE_STREAM_TOKEN_SECRET")
    # The separator cannot occur in a request id or a decimal expiry, so no two grants share a message, and the
    # version prefix keeps the earlier format's MACs (over "<id>\n<tenant>") from ever matching.
    message = f"{_VERSION}\n{request_id}\n{tenant}\n{expires_at}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def issue_stream_token(
    secret: str, request_id: str, tenant: str, *, lifetime_s: float, now: float | None = None
) -> str:
    """The token a client presents to read ``request_id``'s stream, valid for ``lifetime_s`` from ``now``."""
    if lifetime_s <= 0:
        raise ValueError(f"stream token lifetime must be positive, got {lifetime_s}")
    expires_at = int((time.time() if now is None else now) + lifetime_s)
    return f"{tenant}.{expires_at}.{_mac(secret, request_id, tenant, expires_at)}"


def verify_stream_token(secret: str, request_id: str, token: str, *, now: float | None = None) -> str:
    """The tenant the token was issued to.

    Raises :class:`ExpiredStreamToken` for a genuine token past its expiry (checked only once the HMAC holds, so a
    forged token never learns about expiry) and :class:`InvalidStreamToken` for anything else that does not open
    ``request_id``, earlier-format tokens included.
    """
    head, sep, mac = token.rpartition(".")
    tenant, sep2, expiry = head.rpartition(".")
    if not (sep and sep2 and tenant and expiry.isascii() and expiry.isdecimal()):
        raise InvalidStreamToken("invalid stream token for this request")
    expires_at = int(expiry)
    if not hmac.compare_digest(_mac(secret, request_id, tenant, expires_at), mac):
        raise InvalidStreamToken("invalid stream token for this request")
    if (time.time() if now is None else now) >= expires_at:
        raise ExpiredStreamToken(expires_at)
    return tenant
