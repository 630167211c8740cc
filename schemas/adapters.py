"""The LoRA adapter record kept in the Redis registry: what ingress resolves a model name to and what a worker
loads on demand.

An adapter is served under its own name as if it were a model; requests for it keep the base model's topic
(``InferenceRequest.model`` = ``base_model``, ``InferenceRequest.adapter`` = ``name``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AwareDatetime, Field

from .common import Message, utcnow

#: An adapter's name is a model name clients send, so the same alphabet as request ids plus ``/`` (hub style).
AdapterName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9._:/@-]+$",
        description="The adapter's name; clients use it as the model name.",
    ),
]


class LoRAAdapter(Message):
    """One registered LoRA adapter: its name, the base model it applies to, where its files are, and who sees it."""

    name: AdapterName
    base_model: str = Field(min_length=1, max_length=256, description="The served model the adapter applies to.")
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="A local directory or an fsspec URL every worker of the base model can read (PEFT files).",
    )
    lora_int_id: int = Field(
        ge=1, description="Assigned by the registry (Redis INCR) at registration, stable for the adapter's life."
    )
    tenant: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._:@-]+$",
        description="None: visible to every tenant; else private to that tenant.",
    )
    rank: int | None = Field(None, ge=1, description="The adapter's LoRA rank, as the verifying worker read it.")
    created_at: AwareDatetime = Field(default_factory=utcnow)

    def visible_to(self, tenant: str) -> bool:
        """True when ``tenant`` may use the adapter (public, or private to that tenant)."""
        return self.tenant is None or self.tenant == tenant
