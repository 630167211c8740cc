"""API keys: loading them (environment or a keys file), keeping only their SHA-256 hashes, and finding the
key a request presents in ``Authorization: Bearer`` or ``x-api-key``; and ``authenticate``, the caller of a
request (the ``Caller`` dependency), 401 without a valid key.

Keys file format, one entry per line (blank lines and ``#`` comments ignored): either a bare key, or a
JSON object ``{"key": ..., "tenant": ..., "default_tier": ..., "max_tier": ...}`` where ``key_hash``
(hex SHA-256) may replace ``key`` so the file itself need not hold secrets. An object may also set the key's
limits (:class:`sluicegate.api.limits.KeyLimits`): ``rps``, ``rpm``, ``tpm``, ``max_prompt_tokens``, ``max_tokens``,
``max_body_bytes``, ``default_queue_budget_s`` and the key's token quotas ``tokens_per_day`` and ``tokens_per_month``
(tenant quotas are settings: ``SLUICEGATE_TENANT_QUOTAS``, which every admitting process reads). ``"admin": true``
makes it an admin key (so do the keys in ``SLUICEGATE_ADMIN_API_KEYS``): the ``Admin`` dependency, for operations
on the deployment such as loading LoRA adapters, answers 403 to any other key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas import Tier, tier_rank
from sluicegate.api.errors import ApiError
from sluicegate.api.limits import KeyLimits
from sluicegate.settings import comma_separated
from sluicegate.validation_errors import summarize

_TENANT_PATTERN = r"^[A-Za-z0-9._:@-]+$"


def hash_key(key: str) -> str:
    """Hex SHA-256 of an API key: all that is kept in memory."""
    return hashlib.sha256(key.encode()).hexdigest()


def derived_tenant(key_hash: str) -> str:
    """Tenant of a key given without one: stable, and reveals nothing usable about the key."""
    return f"key-{key_hash[:8]}"


class ApiKey(BaseModel):
    """One accepted key: its hash, the tenant it acts for, the tiers it may use and its limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str = Field(min_length=1, max_length=128, pattern=_TENANT_PATTERN)
    default_tier: Tier = "standard"
    max_tier: Tier = "interactive"
    limits: KeyLimits = KeyLimits()
    admin: bool = False

    @property
    def key_id(self) -> str:
        """A short, non-secret id of the key, for rate-limit counters and logs."""
        return self.key_hash[:16]

    @model_validator(mode="after")
    def _default_within_max(self) -> ApiKey:
        if tier_rank(self.default_tier) < tier_rank(self.max_tier):
            raise ValueError(f"default_tier {self.default_tier!r} is above max_tier {self.max_tier!r}")
        return self


class _KeyFileEntry(KeyLimits):
    # Strict: "admin": "yes" or "tokens_per_day": "100" is a mistake to point at, not a value to guess from.
    model_config = ConfigDict(extra="forbid", frozen=False, strict=True)

    key: str | None = Field(None, min_length=8)
    key_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    tenant: str | None = Field(None, min_length=1, max_length=128, pattern=_TENANT_PATTERN)
    default_tier: Tier = "standard"
    max_tier: Tier = "interactive"
    admin: bool = False

    @field_validator("key")
    @classmethod
    def _no_whitespace(cls, value: str | None) -> str | None:
        # A client's key is read without surrounding spaces, so a key holding one could never authenticate; on a
        # plain line it is usually a trailing comment.
        if value is not None and any(c.isspace() for c in value):
            raise ValueError("a key may not contain spaces or tabs (a comment goes on its own line, starting with #)")
        return value

    @model_validator(mode="after")
    def _one_secret(self) -> _KeyFileEntry:
        if (self.key is None) == (self.key_hash is None):
            raise ValueError("give exactly one of 'key' and 'key_hash'")
        return self

    def to_api_key(self) -> ApiKey:
        digest = self.key_hash or hash_key(self.key or "")
        return ApiKey(
            key_hash=digest,
            tenant=self.tenant or derived_tenant(digest),
            default_tier=self.default_tier,
            max_tier=self.max_tier,
            admin=self.admin,
            limits=KeyLimits(**self.model_dump(include=set(KeyLimits.model_fields))),
        )


def parse_keys_file(lines: Iterable[str], *, source: str = "keys file") -> list[ApiKey]:
    """Parse keys-file lines; a bad line is a ``ValueError`` naming the line and the problem."""
    keys: list[ApiKey] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if line.startswith("{"):
                key = _KeyFileEntry.model_validate_json(line).to_api_key()
            else:
                key = _KeyFileEntry(key=line).to_api_key()
        except ValidationError as exc:
            raise ValueError(f"{source} line {number}: {summarize(exc)[1]}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source} line {number}: not valid JSON ({exc})") from None
        if key.key_hash in seen:
            # Which line's tenant and quotas would hold is a guess either way: the later one silently won.
            raise ValueError(f"{source} line {number}: the same key as line {seen[key.key_hash]}")
        seen[key.key_hash] = number
        keys.append(key)
    return keys


class KeyRing:
    """The accepted keys, by hash."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self._by_hash: dict[str, ApiKey] = {}
        for key in keys:
            self._by_hash[key.key_hash] = key

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, presented: str) -> ApiKey | None:
        """The key matching a presented secret, or None."""
        return self._by_hash.get(hash_key(presented)) if presented else None

    @classmethod
    def load(cls, env_keys: str, keys_file: Path | None, admin_keys: str = "") -> KeyRing:
        """Keys from ``SLUICEGATE_API_KEYS`` and ``SLUICEGATE_ADMIN_API_KEYS`` (comma-separated) and the keys file;
        the file wins for a key given in both (it can say more: tenant and tiers)."""
        keys: list[ApiKey] = []
        for variable, listed, admin in (
            ("SLUICEGATE_API_KEYS", env_keys, False),
            ("SLUICEGATE_ADMIN_API_KEYS", admin_keys, True),
        ):
            for number, key in enumerate(comma_separated(listed), start=1):
                try:
                    keys.append(_KeyFileEntry(key=key, admin=admin).to_api_key())
                except ValidationError as exc:
                    raise ValueError(f"{variable} entry {number}: {summarize(exc)[1]}") from None
        if keys_file is not None:
            if not keys_file.is_file():
                raise FileNotFoundError(f"API keys file {keys_file} does not exist")
            keys += parse_keys_file(keys_file.read_text().splitlines(), source=str(keys_file))
        return cls(keys)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key in ``Authorization: Bearer <key>`` or ``x-api-key``, if any."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


_ANONYMOUS = ApiKey(key_hash="0" * 64, tenant="default")


async def authenticate(request: Request) -> ApiKey:
    """The caller's API key; 401 in OpenAI's shape without a valid one.

    Async on purpose: FastAPI runs a plain-function dependency in its thread pool on every request.
    """
    presented = presented_key(request.headers)
    if presented is None:
        if request.app.state.settings.allow_anonymous:
            return _ANONYMOUS
        raise ApiError(
            401,
            "Missing API key: pass it as 'Authorization: Bearer <key>' or in the 'x-api-key' header.",
            code="invalid_api_key",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    key = request.app.state.keyring.lookup(presented)
    if key is None:
        raise ApiError(
            401,
            "Incorrect API key provided.",
            code="invalid_api_key",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return key


Caller = Annotated[ApiKey, Depends(authenticate)]
"""The authenticated caller, as an endpoint parameter (the publishing endpoints call ``authenticate`` themselves)."""


async def require_admin(caller: Caller) -> ApiKey:
    """The caller's key when it is an admin key; 403 in OpenAI's shape for any other (401 without a valid one)."""
    if not caller.admin:
        raise ApiError(
            403,
            'This operation needs an admin API key ("admin": true in the keys file, or SLUICEGATE_ADMIN_API_KEYS).',
            code="admin_key_required",
        )
    return caller


Admin = Annotated[ApiKey, Depends(require_admin)]
"""The authenticated caller holding an admin key, as an endpoint parameter or a router's dependency."""
