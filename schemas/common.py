"""Base model configuration shared by every message: strict, closed, versioned."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1

#: Request ids end up in Redis keys and URLs, so they are limited to a safe alphabet.
RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="Unique request id.")]


def utcnow() -> datetime:
    """Timezone-aware now, the only kind of time the contracts carry."""
    return datetime.now(UTC)


class Message(BaseModel):
    """Every contract rejects unknown fields and wrong types instead of guessing."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
