"""The LoRA adapter registry, shared by every ingress, router and worker through Redis.

One hash (``Names.lora_adapters_key``) maps an adapter's name to its ``LoRAAdapter`` JSON, so any worker can load
an adapter on demand and a request resumed elsewhere finds it. ``lora_int_id`` (the engine's integer id of the
adapter) comes from one Redis counter (``Names.lora_next_id_key``), so it is unique across the deployment and
stable for the adapter's life; a name registered again after an unregister gets a new id, which keeps a worker
that still holds the old files from serving them under the new registration.
"""

from __future__ import annotations

import builtins
import logging

from pydantic import ValidationError
from redis.asyncio import Redis

from schemas import LoRAAdapter, Names
from sluicegate.api.errors import ApiError

log = logging.getLogger(__name__)


class AdapterExistsError(ApiError):
    """Registering a name that is already registered (HTTP 409, OpenAI's error shape)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            409,
            f"LoRA adapter '{name}' is already registered; unload it first",
            code="adapter_exists",
            param="lora_name",
        )
        self.name = name


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class LoRARegistry:
    """Register, look up and remove LoRA adapters in Redis under ``prefix`` (the deployment's topic prefix)."""

    def __init__(self, redis: Redis, prefix: str = "") -> None:
        self.redis = redis
        self.names = Names(prefix)

    async def register(
        self,
        name: str,
        base_model: str,
        path: str,
        *,
        tenant: str | None = None,
        rank: int | None = None,
    ) -> LoRAAdapter:
        """Store a new adapter and return it with its fresh ``lora_int_id``; :class:`AdapterExistsError` when
        the name is taken (the existing registration is left as it is). Invalid fields raise pydantic's
        ``ValidationError`` before anything is written."""
        # Validate before spending an id, so bad input leaves the counter and the hash untouched.
        LoRAAdapter(name=name, base_model=base_model, path=path, lora_int_id=1, tenant=tenant, rank=rank)
        if await self.redis.hexists(self.names.lora_adapters_key, name):
            raise AdapterExistsError(name)
        lora_int_id = int(await self.redis.incr(self.names.lora_next_id_key))
        adapter = LoRAAdapter(
            name=name, base_model=base_model, path=path, lora_int_id=lora_int_id, tenant=tenant, rank=rank
        )
        # HSETNX settles a race between two registrations of one name: the loser's id is simply never used.
        if not await self.redis.hsetnx(self.names.lora_adapters_key, name, adapter.model_dump_json()):
            raise AdapterExistsError(name)
        return adapter

    async def unregister(self, name: str) -> bool:
        """Remove the adapter; False when no adapter has that name."""
        return bool(await self.redis.hdel(self.names.lora_adapters_key, name))

    async def get(self, name: str) -> LoRAAdapter | None:
        """The adapter registered as ``name``, or None (also for an entry that no longer parses, which is logged)."""
        raw = await self.redis.hget(self.names.lora_adapters_key, name)
        return None if raw is None else self._parse(name, raw)

    async def list(self, base_model: str | None = None) -> builtins.list[LoRAAdapter]:
        """Every registered adapter (of ``base_model`` when given), sorted by name."""
        entries = await self.redis.hgetall(self.names.lora_adapters_key)
        adapters = []
        for field, raw in entries.items():
            adapter = self._parse(_text(field), raw)
            if adapter is not None and (base_model is None or adapter.base_model == base_model):
                adapters.append(adapter)
        return sorted(adapters, key=lambda a: a.name)

    def _parse(self, name: str, raw: bytes | str) -> LoRAAdapter | None:
        try:
            return LoRAAdapter.model_validate_json(raw)
        except ValidationError as exc:
            # A hand-edited or foreign entry must not break every lookup: it is skipped, loudly.
            log.warning("lora.registry.bad_entry name=%s key=%s error=%s", name, self.names.lora_adapters_key, exc)
            return None
