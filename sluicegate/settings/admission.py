"""Ingress admission control: how much a model's backlog may hold, and the per-key limits a keys-file entry may
override (``sluicegate.api.limits``)."""

from __future__ import annotations

from pydantic import Field

from .base import SettingsBase


class AdmissionSettings(SettingsBase):
    """Backlog bound and the default per-key limits: body size, rates, prompt and output sizes, token quotas."""

    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body accepted (413 above).")
    max_backlog_per_model: int = Field(
        1000,
        ge=0,
        description="Requests accepted but not started a model may hold (at or above a request's tier) before "
        "ingress answers 429; 0 disables the bound.",
    )
    backlog_cache_s: float = Field(
        1.0, gt=0, description="Seconds ingress reuses a model's backlog estimate (consumer lag) before re-reading it."
    )
    backlog_retry_after_s: int = Field(2, ge=1, description="Retry-After (seconds) of a 429 for a full backlog.")
    limit_rps: float = Field(0.0, ge=0, description="Default requests per second per API key; 0 means unlimited.")
    limit_rpm: int = Field(
        0,
        ge=0,
        description="Default requests per minute per API key, as a token bucket: a burst of that many, refilled "
        "evenly over the minute; 0 means unlimited.",
    )
    limit_tpm: int = Field(
        0, ge=0, description="Default tokens (prompt estimate + max_tokens) per minute per API key; 0 means unlimited."
    )
    limit_prompt_tokens: int = Field(
        0, ge=0, description="Default largest prompt per request, in estimated tokens; 0 means unlimited."
    )
    limit_max_tokens: int = Field(
        0, ge=0, description="Default largest max_tokens a request may ask for; 0 means unlimited."
    )
    limit_tokens_per_day: int = Field(
        0, ge=0, description="Default token quota per API key per UTC day (prompt + output); 0 means none."
    )
    limit_tokens_per_month: int = Field(0, ge=0, description="Default token quota per API key per UTC month; 0: none.")
