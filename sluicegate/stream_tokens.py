"""Stream tokens: HMACs that let one client read one request's stream and nothing else.

Ingress issues a token bound to the request id and tenant; the result service checks it. Browsers
cannot set WebSocket headers, so the token travels as ``?token=``.
"""

from __future__ import annotations

import hashlib
import hmac


def _mac(secret: str, request_id: str, tenant: str) -> str:
    if not secret:
        raise ValueError("stream token secret is empty: set SLUICEGATE_STREAM_TOKEN_SECRET")
    # The separator cannot occur in a request id, so (id, tenant) pairs cannot be confused.
    message = f"{request_id}\n{tenant}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def issue_stream_token(secret: str, request_id: str, tenant: str) -> str:
    """The token a client presents to read ``request_id``'s stream: ``<tenant>.<hex mac>``."""
    return f"{tenant}.{_mac(secret, request_id, tenant)}"


def verify_stream_token(secret: str, request_id: str, token: str) -> str | None:
    """The tenant the token was issued to, or None when it does not open ``request_id``."""
    tenant, sep, mac = token.rpartition(".")
    if not sep or not tenant:
        return None
    expected = _mac(secret, request_id, tenant)
    return tenant if hmac.compare_digest(expected, mac) else None
