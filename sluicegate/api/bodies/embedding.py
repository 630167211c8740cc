"""One input of ``POST /v1/embeddings``, accepted like any other request body."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    Field,
)

from schemas import (
    EndUser,
    GuidedSpec,
    Pooling,
    SamplingOptions,
    Tier,
)

from .base import (
    DeadlineBody,
)


class EmbeddingInput(DeadlineBody):
    """One input of ``POST /v1/embeddings`` (:class:`sluicegate.api.embeddings.EmbeddingBody` splits a list into
    these): accepted like any other request, and built into one prefill-only ``task: embed`` request."""

    model: str = Field(min_length=1, max_length=256)
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    pooling: Pooling = "last"
    priority: Tier | None = None
    user: EndUser | None = None

    def guided_spec(self) -> GuidedSpec | None:
        return None

    def resolved_max_tokens(self) -> int:
        """1: an embedding generates nothing, but the contract's ``max_tokens`` is at least 1 (the engine ignores
        it; the context check counts the prompt alone)."""
        return 1

    def sampling(self, max_tokens: int) -> SamplingOptions:
        """The defaults (never deterministic-looking, so never a response-cache entry)."""
        return SamplingOptions(max_tokens=1)
