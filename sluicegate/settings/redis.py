"""Redis: the server every service reaches, and how long the request state it keeps there lives."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from .base import SettingsBase


class RedisSettings(SettingsBase):
    """The Redis server and the lifetimes of a request's streams and records in it."""

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL for streams, limits, state: redis://, rediss:// (TLS), redis+sentinel:// or "
        "rediss+sentinel:// (forms and TLS query parameters: docs/deploy.md, 'Redis with TLS and ACL users').",
    )
    redis_tls_ca_file: Path | None = Field(
        None, description="CA bundle checking the Redis servers' certificates when the URL has no ssl_ca_certs."
    )
    redis_tls_cert_file: Path | None = Field(
        None, description="Client certificate shown to a TLS Redis when the URL has no ssl_certfile."
    )
    redis_tls_key_file: Path | None = Field(
        None, description="The client certificate's key when the URL has no ssl_keyfile."
    )
    stream_ttl_s: int = Field(3600, ge=1, description="Seconds a finished Redis stream is kept.")
    request_record_ttl_s: int = Field(
        86400, ge=1, description="Seconds a request's status record and cancel marker are kept in Redis."
    )

    @property
    def stream_token_lifetime_s(self) -> int:
        """Seconds a stream token stays valid after issue: the request's longest life (its status record and cancel
        marker are kept ``request_record_ttl_s``) plus the finished stream's retention (``stream_ttl_s``)."""
        return self.request_record_ttl_s + self.stream_ttl_s
