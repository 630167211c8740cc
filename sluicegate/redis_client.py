"""Redis client setup shared by every service: one async client factory with timeouts that suit
blocking stream reads, and a readiness wait.

Besides ``redis://`` and ``rediss://``, ``redis+sentinel://host:port[,host:port...]/service_name[/db]`` (and
``rediss+sentinel://`` over TLS, with ACL users for the primary and the Sentinels: :mod:`sluicegate.redis_urls`)
asks those Sentinels for the primary of ``service_name`` (redis-py's ``Sentinel``): the client re-asks them after
a connection error, so a failover to a promoted replica is a short stall, not an outage.

Values stay bytes (``decode_responses=False``): stream entries carry JSON and token ids that the
caller decodes once, and entry ids compare correctly as bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluicegate.redis_urls import is_sentinel_url, mask_url, parse_sentinel_url, tls_options
from sluicegate.settings import RedisSettings


def client_for_url(url: str, settings: RedisSettings | None = None, **options: Any) -> Redis:
    """``Redis.from_url``, or the Sentinel-discovered primary for a ``redis+sentinel://`` (``rediss+sentinel://``)
    URL; a TLS URL checks the server's certificate unless it says ``ssl_cert_reqs=none`` (:mod:`sluicegate.redis_urls`
    has the forms)."""
    if not is_sentinel_url(url):
        tls = tls_options(url, settings)
        # from_url lets the URL's own query parameters win over these defaults.
        return Redis.from_url(url, **(tls.redis_py() if tls else {}), **options)
    target = parse_sentinel_url(url, settings)
    tls = {"ssl": True, **target.tls.redis_py()} if target.tls else {}
    probe = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if k in options}
    # Sentinels answer quickly or not at all: bound their calls even when data reads may block for long.
    probe["socket_timeout"] = probe.get("socket_timeout") or 2.0
    auth = {"username": target.sentinel_username, "password": target.sentinel_password}
    sentinel = Sentinel(target.sentinels, sentinel_kwargs={**probe, **auth, **tls})
    return sentinel.master_for(
        target.service,
        redis_class=Redis,
        db=target.db,
        username=target.username,
        password=target.password,
        **tls,
        **options,
    )


def create_redis(
    settings: RedisSettings | None = None,
    *,
    url: str | None = None,
    socket_timeout: float | None = None,
    connect_timeout: float = 5.0,
    health_check_interval: int = 30,
    client_name: str | None = "sluicegate",
    max_connections: int | None = None,
    retries: int = 3,
    retry_timeouts: bool = True,
) -> Redis:
    """An async Redis client for ``url`` (default ``RedisSettings.redis_url``).

    ``socket_timeout`` bounds every read on the socket, so it must exceed the longest ``BLOCK`` of an
    ``XREAD``/``XREADGROUP`` issued on this client; ``None`` (the default) means no read timeout, which
    is right for relays that block on streams. Connection setup is always bounded by
    ``connect_timeout``. Commands are retried ``retries`` times (default three) on connection errors with a
    short backoff: every write Sluicegate makes is idempotent (stream entry ids derive from a sequence number).
    ``retry_timeouts`` False retries refused connections only: a server that hangs is waited for once, not
    ``retries`` + 1 times (a caller that owes someone an answer soon).
    """
    if socket_timeout is not None and socket_timeout <= 0:
        raise ValueError(f"socket_timeout must be positive or None, got {socket_timeout}")
    settings = settings or RedisSettings()
    return client_for_url(
        url or settings.redis_url,
        settings,
        decode_responses=False,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        socket_keepalive=True,
        health_check_interval=health_check_interval,
        client_name=client_name,
        max_connections=max_connections,
        # Retries connection and (unless told not to) timeout errors.
        retry=Retry(
            ExponentialBackoff(cap=1.0, base=0.05),
            retries=retries,
            supported_errors=(RedisConnectionError, RedisTimeoutError) if retry_timeouts else (RedisConnectionError,),
        ),
    )


async def wait_for_redis(
    url: str | None = None,
    timeout_s: float = 15.0,
    *,
    interval_s: float = 0.1,
    check: Callable[[], None] | None = None,
) -> str:
    """Wait until the Redis server at ``url`` answers PING; returns its version.

    ``check`` runs between attempts and may raise to give up early (e.g. the server process exited).
    Raises ``TimeoutError`` with the last error when it does not answer within ``timeout_s``.
    """
    url = url or RedisSettings().redis_url
    deadline = time.monotonic() + timeout_s
    while True:
        # No retries inside a probe: the loop here is the retry, with its own deadline.
        client = client_for_url(
            url, socket_timeout=2.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), retries=0)
        )
        try:
            await client.ping()
            info = await client.info("server")
            return str(info.get("redis_version", "unknown"))
        except (RedisError, OSError) as exc:
            last: Exception = exc
        finally:
            await client.aclose()
        if check is not None:
            check()
        if time.monotonic() + interval_s > deadline:
            raise TimeoutError(f"Redis at {mask_url(url)} not ready after {timeout_s:.0f}s: {last}")
        await asyncio.sleep(interval_s)
