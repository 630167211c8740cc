"""The start-up check of a service's Redis: can it connect, log in as its ACL user and reach its keys? Each
failure becomes one line that names the cause (wrong password, unknown CA, a plaintext client on a TLS port, a
missing permission with the command or key), with the URL's password masked, instead of a traceback from the
first request that happens to touch Redis.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluicegate.redis_client import client_for_url
from sluicegate.redis_urls import is_tls_url, mask_url, username_of
from sluicegate.settings import RedisSettings


class RedisAccessError(RuntimeError):
    """Redis refused this service: the message is one line naming why."""


def describe_redis_error(exc: BaseException, url: str, *, key: str | None = None) -> str:
    """One line saying why the Redis at ``url`` refused a client (``key``: the key it was asked about)."""
    where = f"Redis at {mask_url(url)}"
    user = username_of(url)
    cause = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    if isinstance(exc, NoPermissionError) or text.startswith("NOPERM"):
        on_key = f" (key {key!r})" if key and "key" in text else ""
        return f"{where}: ACL user {user!r} lacks a permission: {text}{on_key} (NOPERM; see `sluicegate redis acls`)"
    if isinstance(exc, AuthenticationError) or "WRONGPASS" in text:
        return f"{where}: ACL user {user!r} was refused: wrong password, or no such user or it is off (WRONGPASS)"
    if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        reason = getattr(cause, "verify_message", None) or text
        return (
            f"{where}: the server's TLS certificate was not accepted ({reason}): give the CA that signed it as "
            "ssl_ca_certs in the URL or SLUICEGATE_REDIS_TLS_CA_FILE"
        )
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
        # A TLS port resets (or closes on) a client that does not open with a TLS handshake.
        reset = isinstance(cause, ConnectionResetError) or "closed by server" in text
        hint = ""
        if reset and not is_tls_url(url):
            hint = "; if that port speaks TLS, use rediss:// (or rediss+sentinel://)"
        return f"{where}: cannot connect: {text or type(exc).__name__}{hint}"
    return f"{where}: {type(exc).__name__}: {text}"


async def check_redis_access(
    settings: RedisSettings, *, url: str | None = None, keys: Sequence[str] = (), timeout_s: float = 5.0
) -> None:
    """PING the Redis at ``url`` (default ``settings.redis_url``) as its user, then ask whether each of ``keys``
    exists (a key the user may not touch is refused); raises :class:`RedisAccessError` with one line on the
    first refusal."""
    url = url or settings.redis_url
    client = client_for_url(
        url,
        settings,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), retries=0),
        client_name="sluicegate-check",
    )
    try:
        try:
            await client.ping()
        except (RedisError, OSError) as exc:
            raise RedisAccessError(describe_redis_error(exc, url)) from exc
        for key in keys:
            try:
                await client.exists(key)
            except RedisError as exc:
                raise RedisAccessError(describe_redis_error(exc, url, key=key)) from exc
    finally:
        await client.aclose()
