"""The LoRA adapters a worker serves: named at start, looked up in the Redis registry per request, fetched to local
disk, loaded into the engine, advertised in heartbeats, and verified for ingress's registrations.

A request naming an adapter (``InferenceRequest.adapter``) is resolved here to the engine's ``LoRARequest``:
registry lookup (cached a few seconds, so an unregister is seen soon), the adapter's files fetched to the worker's
cache when the registry names an fsspec URL, and the adapter loaded into the engine's CPU pool once (the engine
moves it to a device slot when a step needs it). Anything that makes the request unservable is an
:class:`AdapterError` with a machine-readable code, which the serving code turns into the request's ``error``
event: nothing here crashes the worker or loses a record. Disk and network work runs in threads.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpu_workers.engine import EngineFront
from gpu_workers.engine.lora.peft_files import LoRAError, load_adapter
from gpu_workers.engine.lora.request import LoRARequest
from schemas import InferenceRequest, LoRAAdapter
from sluicegate.lora.checks import CheckVerdict
from sluicegate.lora.registry import LoRARegistry

from .adapter_files import AdapterFetchError, cache_entry, fetch_adapter, is_remote

log = logging.getLogger(__name__)


def lora_kwargs(lora: LoRARequest | None) -> dict[str, LoRARequest]:
    """``add_request``'s LoRA argument: none at all for a base-model request."""
    return {} if lora is None else {"lora_request": lora}


class AdapterError(Exception):
    """A request's adapter cannot be served here: ``code`` for its ``error`` event, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def resolve_adapter(
    adapters: Adapters | None, request: InferenceRequest, redis_call: Callable[[Callable[[], Any]], Any]
) -> LoRARequest:
    """``request``'s adapter as the engine takes it, through ``redis_call`` (which waits out Redis outages);
    :class:`AdapterError` when this worker cannot serve it (unknown, unloadable, or LoRA off here)."""
    if adapters is None:
        raise AdapterError(
            "adapter_not_found",
            f"LoRA adapter '{request.adapter}': this worker of model '{request.model}' serves no adapters "
            "(SLUICEGATE_ENABLE_LORA is off)",
        )
    return await redis_call(lambda: adapters.resolve(request))


async def _settle(result: Any) -> Any:
    """An engine front's answer, whether it returns it (``LLM``) or a coroutine (the async fronts run the call
    between steps, on the step loop)."""
    return await result if inspect.isawaitable(result) else result


class Adapters:
    """Resolves, loads and lists one worker's LoRA adapters, for the base model it serves."""

    def __init__(
        self,
        engine: EngineFront,
        registry: LoRARegistry,
        *,
        model_name: str,
        cache_dir: Path,
        max_lora_rank: int,
        model_config: Callable[[], Any],
        lookup_ttl_s: float = 2.0,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.model_name = model_name
        self.cache_dir = cache_dir
        self.max_lora_rank = max_lora_rank
        self._model_config_loader = model_config  # blocking (reads config.json): called in a thread, once
        self._model_config: Any = None
        self.lookup_ttl_s = lookup_ttl_s
        # name -> (monotonic time of the lookup, the registered adapter); only hits are kept.
        self._lookups: dict[str, tuple[float, LoRAAdapter]] = {}
        # lora_int_id -> the request the engine holds under it (what this worker loaded and has not removed).
        self._loaded: dict[int, LoRARequest] = {}
        self._loading: dict[int, asyncio.Task[LoRARequest]] = {}
        self._held_names: list[str] = []  # what the engine said it holds, at the last refresh

    # --- at start -----------------------------------------------------------------------------------------------
    async def preload(self, named: Mapping[str, str]) -> list[LoRARequest]:
        """Register each ``name -> path`` (unless the name is registered already) and load it into the engine.

        An adapter that cannot be registered or loaded stops the worker with the reason, as a model that cannot
        load does: a worker told to serve an adapter must not join its group without it.
        """
        loaded = []
        for name, path in named.items():
            adapter = await self.registry.get(name)
            if adapter is None:
                verdict = await self.verify(name, path)
                if not verdict.ok:
                    raise RuntimeError(f"LoRA adapter '{name}' ({path}): {verdict.reason}")
                try:
                    adapter = await self.registry.register(name, self.model_name, path, rank=verdict.rank)
                except Exception as exc:  # another worker registered it meanwhile: use that registration
                    adapter = await self.registry.get(name)
                    if adapter is None:
                        raise RuntimeError(f"LoRA adapter '{name}' could not be registered: {exc}") from exc
            if adapter.base_model != self.model_name:
                raise RuntimeError(
                    f"LoRA adapter '{name}' is registered for model '{adapter.base_model}', not '{self.model_name}'"
                )
            if adapter.path != path:
                log.warning(
                    "worker.lora_registered_elsewhere",
                    extra={"adapter": name, "registered_path": adapter.path, "given_path": path},
                )
            self._lookups[name] = (time.monotonic(), adapter)
            try:
                loaded.append(await self._load(adapter))
            except AdapterError as exc:
                raise RuntimeError(str(exc)) from exc
        return loaded

    # --- per request --------------------------------------------------------------------------------------------
    def ready(self, request: InferenceRequest) -> LoRARequest | None:
        """The engine's request for ``request``'s adapter when it needs no I/O now (looked up recently, loaded);
        None otherwise. For starting the engine early, before the request's task runs."""
        if request.adapter is None:
            return None
        hit = self._lookups.get(request.adapter)
        if hit is None or time.monotonic() - hit[0] > self.lookup_ttl_s or not hit[1].visible_to(request.tenant):
            return None
        loaded = self._loaded.get(hit[1].lora_int_id)
        return loaded if loaded is not None and hit[1].base_model == self.model_name else None

    async def resolve(self, request: InferenceRequest) -> LoRARequest:
        """The engine's ``LoRARequest`` for ``request.adapter``, loaded; :class:`AdapterError` when it cannot be."""
        name = request.adapter
        assert name is not None
        adapter = await self._lookup(name)
        if adapter is None or not adapter.visible_to(request.tenant):
            raise AdapterError("adapter_not_found", f"LoRA adapter '{name}' does not exist")
        if adapter.base_model != self.model_name:
            raise AdapterError(
                "adapter_not_found",
                f"LoRA adapter '{name}' is an adapter of model '{adapter.base_model}', not of '{self.model_name}'",
            )
        return await self._load(adapter)

    async def _lookup(self, name: str) -> LoRAAdapter | None:
        hit = self._lookups.get(name)
        if hit is not None and time.monotonic() - hit[0] <= self.lookup_ttl_s:
            return hit[1]
        adapter = await self.registry.get(name)
        if adapter is None:
            self._lookups.pop(name, None)
            await self._forget(name, keep_id=None)  # unregistered: free its engine memory
        else:
            self._lookups[name] = (time.monotonic(), adapter)
        return adapter

    async def _load(self, adapter: LoRAAdapter) -> LoRARequest:
        """Fetch and load ``adapter`` once, however many requests ask for it at the same time."""
        held = self._loaded.get(adapter.lora_int_id)
        if held is not None:
            return held
        task = self._loading.get(adapter.lora_int_id)
        if task is None:
            task = asyncio.create_task(self._fetch_and_add(adapter), name=f"lora-load-{adapter.name}")
            self._loading[adapter.lora_int_id] = task
            task.add_done_callback(lambda _: self._loading.pop(adapter.lora_int_id, None))
        # Shielded: one request's cancellation must not cancel the load others wait on.
        return await asyncio.shield(task)

    async def _fetch_and_add(self, adapter: LoRAAdapter) -> LoRARequest:
        try:
            local = await asyncio.to_thread(fetch_adapter, adapter.path, self.cache_dir, str(adapter.lora_int_id))
        except AdapterFetchError as exc:
            raise AdapterError("adapter_load_failed", f"LoRA adapter '{adapter.name}': {exc}") from exc
        lora = LoRARequest(adapter.name, adapter.lora_int_id, str(local))
        # A name registered again has a new id: the engine lets go of the old registration's weights first.
        await self._forget(adapter.name, keep_id=adapter.lora_int_id)
        try:
            await _settle(self.engine.add_lora(lora))
        except (LoRAError, ValueError, OSError) as exc:
            raise AdapterError("adapter_load_failed", f"LoRA adapter '{adapter.name}' failed to load: {exc}") from exc
        self._loaded[adapter.lora_int_id] = lora
        log.info("worker.lora_loaded", extra={"adapter": adapter.name, "lora_int_id": adapter.lora_int_id})
        return lora

    async def _forget(self, name: str, *, keep_id: int | None) -> None:
        for lora_id, lora in list(self._loaded.items()):
            if lora.lora_name == name and lora_id != keep_id:
                del self._loaded[lora_id]
                try:
                    await _settle(self.engine.remove_lora(lora_id))
                except Exception as exc:  # best effort: the engine's LRU evicts it anyway
                    log.warning("worker.lora_remove_failed", extra={"adapter": name, "error": repr(exc)})

    # --- heartbeats and checks ----------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Names of the adapters the engine held at the last :meth:`refresh` (CPU pool or device), for heartbeats."""
        return self._held_names

    async def refresh(self) -> None:
        """Ask the engine which adapters it holds (before each heartbeat). One it evicted (least recently used) is
        forgotten here too; a later request for it loads it again."""
        try:
            held = await _settle(self.engine.list_loras())
        except Exception as exc:  # an engine that is stopping: the beat goes out with what was known
            log.warning("worker.lora_list_failed", extra={"error": repr(exc)})
            return
        ids = {lora.lora_int_id for lora in held}
        for lora_id in [i for i in self._loaded if i not in ids]:
            del self._loaded[lora_id]
        self._held_names = sorted({lora.lora_name for lora in held})

    async def verify(self, name: str, path: str) -> CheckVerdict:
        """Whether adapter ``name`` at ``path`` fits this worker's base model (``serve_checks``' verifier): its files
        fetched like a request's, checked against the model's config and its tensors read as a load reads them (a
        NaN or infinite weight is refused now, not registered to fail every request that names it)."""
        checks_dir, tag = self.cache_dir / "checks", uuid.uuid4().hex  # a copy per check: checks may overlap
        try:
            local = await asyncio.to_thread(fetch_adapter, path, checks_dir, tag)
            if self._model_config is None:
                self._model_config = await asyncio.to_thread(self._model_config_loader)
            weights = await asyncio.to_thread(
                load_adapter, str(local), self._model_config, max_lora_rank=self.max_lora_rank
            )
            spec = weights.spec
        except (LoRAError, AdapterFetchError) as exc:
            return CheckVerdict(ok=False, reason=str(exc))  # the problem; whoever reports it names the adapter
        finally:
            if is_remote(path):  # a check's copy is not kept: the adapter may never be registered
                await asyncio.to_thread(shutil.rmtree, cache_entry(checks_dir, path, tag), True)
        return CheckVerdict(ok=True, rank=spec.rank)
