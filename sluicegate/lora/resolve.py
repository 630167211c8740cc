"""The one resolution of a model name that is a LoRA adapter, used by every path a request enters by: ingress's
OpenAI and native APIs (through ``ingress.accept``), ``/v1/models``, the router for Kafka-native records and the
batch service for batch lines.

A name registered as an adapter (and visible to the request's tenant) becomes ``model=<base>`` +
``adapter=<name>``, so the request keeps the base model's topic and workers; any other name is left alone and
meets the usual model checks (its 404 ``model_not_found``). A private adapter of another tenant is therefore
indistinguishable from a name nobody registered. A Kafka-native record may also name the adapter in ``adapter``
with ``model`` = its base (or the adapter's own name): then an unknown or invisible adapter is the same 404, and
one of another base model is a 400.

:class:`AdapterResolver` keeps a snapshot of the registry for ``ttl_s`` seconds, so the hot path costs no Redis
round trip per request; a process's own load or unload calls :meth:`AdapterResolver.invalidate`, other processes
see it within the TTL. The pure functions (:func:`resolve_name`, :func:`resolve_request`) take a snapshot, for
callers that resolve off the event loop (the batch service's validation thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from redis.exceptions import RedisError

from schemas import InferenceRequest, LoRAAdapter
from sluicegate.api.errors import ApiError

from .registry import LoRARegistry

log = logging.getLogger(__name__)

Adapters = Mapping[str, LoRAAdapter]

#: After a failed refresh, how long the last good snapshot is served before Redis is asked again.
_RETRY_AFTER_FAILURE_S = 0.5


class UnknownAdapterError(ApiError):
    """An ``adapter`` that is not registered or not visible to the tenant: the 404 an unknown model gets."""

    def __init__(self, name: str, *, param: str = "adapter") -> None:
        super().__init__(
            404, f"The model '{name}' does not exist or has no live worker.", code="model_not_found", param=param
        )


class AdapterMismatchError(ApiError):
    """An ``adapter`` named with a ``model`` that is not its base (400)."""

    def __init__(self, adapter: LoRAAdapter, model: str) -> None:
        super().__init__(
            400,
            f"LoRA adapter '{adapter.name}' applies to model '{adapter.base_model}', not '{model}'.",
            code="adapter_mismatch",
            param="adapter",
        )


@dataclass(frozen=True)
class Resolved:
    """Where a request goes: the model (the base model for an adapter) and the adapter's name (None: none)."""

    model: str
    adapter: str | None = None


def resolve_name(adapters: Adapters, model: str, *, tenant: str, adapter: str | None = None) -> Resolved:
    """``model`` (and an explicit ``adapter``) resolved against the ``adapters`` snapshot for ``tenant``."""
    if adapter is None:
        found = adapters.get(model)
        if found is None or not found.visible_to(tenant):
            return Resolved(model)
        return Resolved(found.base_model, found.name)
    found = adapters.get(adapter)
    if found is None or not found.visible_to(tenant):
        raise UnknownAdapterError(adapter)
    if model not in (found.base_model, found.name):
        raise AdapterMismatchError(found, model)
    return Resolved(found.base_model, found.name)


def resolve_request(adapters: Adapters, request: InferenceRequest) -> InferenceRequest:
    """``request`` with its model name resolved: for an adapter, ``model`` = its base and ``adapter`` = its name
    (unchanged when neither names one)."""
    resolved = resolve_name(adapters, request.model, tenant=request.tenant, adapter=request.adapter)
    if resolved.model == request.model and resolved.adapter == request.adapter:
        return request
    return request.model_copy(update={"model": resolved.model, "adapter": resolved.adapter})


class AdapterResolver:
    """A briefly cached view of the registry that resolves model names (see the module docstring)."""

    def __init__(
        self, registry: LoRARegistry, *, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must not be negative, got {ttl_s}")
        self.registry = registry
        self._ttl_s = ttl_s
        self._clock = clock
        self._adapters: dict[str, LoRAAdapter] | None = None
        self._fresh_until = float("-inf")
        self._lock = asyncio.Lock()

    def invalidate(self) -> None:
        """Forget the snapshot: the next resolution reads the registry (after this process's load or unload)."""
        self._fresh_until = float("-inf")

    async def snapshot(self) -> Adapters:
        """Every registered adapter by name, at most ``ttl_s`` old. When Redis fails, the last snapshot is served
        (logged) if there is one; without one the ``RedisError`` propagates (a 503 at ingress)."""
        if self._adapters is not None and self._clock() < self._fresh_until:
            return self._adapters
        async with self._lock:  # one refresh at a time: concurrent requests wait for it instead of piling on Redis
            if self._adapters is not None and self._clock() < self._fresh_until:
                return self._adapters
            try:
                adapters = {a.name: a for a in await self.registry.list()}
            except (RedisError, OSError) as exc:
                if self._adapters is None:
                    raise
                log.warning("lora.resolver.stale_snapshot error=%r", exc)
                self._fresh_until = self._clock() + _RETRY_AFTER_FAILURE_S
                return self._adapters
            self._adapters = adapters
            self._fresh_until = self._clock() + self._ttl_s
            return adapters

    async def resolve(self, model: str, *, tenant: str, adapter: str | None = None) -> Resolved:
        """``model`` (and an explicit ``adapter``) for ``tenant``; see :func:`resolve_name`. An explicit adapter
        missing from the snapshot is looked up once more in Redis (it may have been registered elsewhere since)."""
        adapters = await self.snapshot()
        if adapter is not None and adapter not in adapters:
            self.invalidate()
            adapters = await self.snapshot()
        return resolve_name(adapters, model, tenant=tenant, adapter=adapter)

    async def resolve_request(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` resolved (see :func:`resolve_request`)."""
        adapters = await self.snapshot()
        if request.adapter is not None and request.adapter not in adapters:
            self.invalidate()
            adapters = await self.snapshot()
        return resolve_request(adapters, request)

    async def lora_int_id(self, adapter: str | None) -> int | None:
        """The registry id of ``adapter`` (None for none, or one gone from the registry): it seeds the adapter's
        KV block hash chain in every worker's engine, so the router can hash a prompt as that engine does."""
        if adapter is None:
            return None
        found = (await self.snapshot()).get(adapter)
        return found.lora_int_id if found is not None else None

    async def visible(self, tenant: str) -> list[LoRAAdapter]:
        """The adapters ``tenant`` may use (public ones and its own), sorted by name."""
        adapters = await self.snapshot()
        return [a for name, a in sorted(adapters.items()) if a.visible_to(tenant)]
