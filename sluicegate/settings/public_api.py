"""The public face of the two HTTP services, ingress and the result service: where each listens, how clients and
browsers reach them, and who may call them. Each reads the other's side too: ingress hands out stream URLs and
allows the result service's origin, and the result service's chat page calls ingress with a configured key."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from .base import SettingsBase


class PublicApiSettings(SettingsBase):
    """Ports, public URLs, browser origins, API keys and the stream-token secret."""

    ingress_port: int = Field(8000, description="HTTP port of the ingress API.")
    result_port: int = Field(8001, description="HTTP/WebSocket port of the result service.")
    public_stream_url: str = Field(
        "ws://127.0.0.1:8001", description="Base URL clients use to reach the result service."
    )
    cors_origins: str = Field(
        "",
        description="Extra comma-separated CORS origins for ingress and the result service's SSE relay (the result "
        "service's own is always allowed).",
    )
    api_keys: str = Field("", description="Comma-separated API keys accepted by ingress.")
    api_keys_file: Path | None = Field(
        None,
        description="Keys file: a key per line, or JSON lines (key, tenant, default_tier, max_tier, the key's limits "
        "and token quotas); a request asking a tier above its key's max_tier runs at max_tier.",
    )
    admin_api_keys: str = Field(
        "",
        description="Comma-separated API keys that are also admin keys (accepted like SLUICEGATE_API_KEYS): they may "
        'load and unload LoRA adapters. A keys-file entry is one with "admin": true.',
    )
    allow_anonymous: bool = Field(
        False, description="Accept requests without an API key (tenant 'default'); for local demos only."
    )
    stream_token_secret: str = Field(
        "", description="HMAC secret for stream tokens; generated per `sluicegate up` when empty."
    )
