"""The asyncio face every engine front shares: one ``RequestStream`` per request, fed on the event loop.

``EngineFront.add_request`` builds the request's one ``EngineRequest``, admits it and opens its stream.
``AsyncEngine`` (step loop in a thread) and ``ProcessEngine`` (step loop in a child process) differ only in
how the request reaches the step loop and how its deltas come back; both hand the deltas to
``EngineFront._deliver`` on the event loop, which routes each to its request's stream.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..core.request import EngineRequest, PromptInput
from ..lora.peft_files import AdapterSpec
from ..lora.request import LoRARequest
from ..outputs import EngineStats, KVCacheEvents, RequestDelta
from ..sampling_params import SamplingParams


class RequestStream:
    """Async iterator over one request's ``RequestDelta``s; ends after the finished delta of each of its
    ``num_choices`` choices (``SamplingParams.n``; deltas carry their choice in ``index``)."""

    def __init__(self, request_id: str, num_choices: int = 1) -> None:
        self.request_id = request_id
        self.num_choices = num_choices
        self.finished = False
        # Finished deltas handed in by the step loop, and handed out to the reader.
        self.num_finished_put = 0
        self._num_finished_read = 0
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def put(self, item: RequestDelta | BaseException) -> None:
        if isinstance(item, RequestDelta) and item.finished:
            self.num_finished_put += 1
        self._queue.put_nowait(item)

    @property
    def all_put(self) -> bool:
        """Every choice's finished delta has been handed in."""
        return self.num_finished_put >= self.num_choices

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self._num_finished_read += 1
            if self._num_finished_read >= self.num_choices:
                self.finished = True
        return item


#: ``LLMEngine`` methods a front may run on the step loop through ``_engine_call`` (and nothing else).
ENGINE_CALLS = frozenset({"add_lora", "remove_lora", "list_loras", "check_lora", "kv_snapshot"})


class EngineFront(ABC):
    """Continuous-batching engine as asyncio servers use it: ``add_request`` (or ``generate``), ``abort``,
    ``stats``; ``async with`` or ``start()``/``shutdown()``. Call every method on the event loop."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._delta_observers: list[Callable[[list[RequestDelta]], None]] = []
        self._kv_event_observers: list[Callable[[KVCacheEvents], None]] = []

    def add_delta_observer(self, observer: Callable[[list[RequestDelta]], None]) -> None:
        """Call ``observer`` with each step's deltas as they reach the event loop, before their streams get them
        (timing probes, metrics). It runs on the event loop for every step: keep it cheap and never raise."""
        self._delta_observers.append(observer)

    def add_kv_event_observer(self, observer: Callable[[KVCacheEvents], None]) -> None:
        """Call ``observer`` with each step's prefix-cache changes (engines built with ``enable_kv_events``), in
        step order and before that step's deltas, on the event loop: keep it cheap and never raise."""
        self._kv_event_observers.append(observer)

    async def kv_snapshot(self) -> KVCacheEvents:
        """Every block the prefix cache holds, taken between steps: the events observed after it continue it."""
        return await self._engine_call("kv_snapshot")

    # ------------------------------------------------------------------ what a front provides
    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The context length (prompt + output tokens) one request may reach."""

    @property
    def architecture(self) -> str | None:
        """The registry's name of the model's architecture (e.g. Qwen3ForCausalLM); None before it is known."""
        return None

    @property
    def arithmetic(self) -> str | None:
        """What the engine's numbers depend on besides the model (``LLMEngine.arithmetic``); None before it is
        known."""
        return None

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the step loop; requests still in flight finish with ``finish_reason="abort"``."""

    @abstractmethod
    def _ensure_accepting(self) -> None:
        """Raise ``RuntimeError`` when the front cannot take requests now (or get ready to take them)."""

    @abstractmethod
    def _admit(self, request: EngineRequest) -> EngineRequest:
        """Admission on the event loop: the request tokenized, or ``ValueError`` for one that can never run."""

    @abstractmethod
    def _submit(self, request: EngineRequest) -> None:
        """Hand an admitted request to the step loop (never waits)."""

    @abstractmethod
    def _abort_soon(self, request_id: str) -> None:
        """Ask the step loop to abort a request (never waits)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Snapshot taken after the step loop's latest step (cheap, never blocks)."""

    @abstractmethod
    async def _engine_call(self, method: str, *args: Any) -> Any:
        """Run one of ``ENGINE_CALLS`` on the ``LLMEngine`` between steps, where the step loop runs; its result,
        or its exception raised here."""

    # ------------------------------------------------------------------ adapters (run on the step loop)
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check and load a LoRA adapter into the engine's CPU pool; True when newly loaded. ``LoRAError`` (a
        ``ValueError``, one line) for an adapter the engine cannot use."""
        return bool(await self._engine_call("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (once its unfinished requests are done); False when it is not loaded."""
        return bool(await self._engine_call("remove_lora", lora_int_id))

    async def check_lora(self, lora_path: str) -> AdapterSpec:
        """Vet an adapter folder against the engine's model and ``max_lora_rank`` without loading it; its
        ``AdapterSpec`` (rank, alpha, target modules, base), or ``LoRAError`` (one line) naming the problem."""
        spec = await self._engine_call("check_lora", lora_path)
        assert isinstance(spec, AdapterSpec)
        return spec

    async def list_loras(self) -> list[LoRARequest]:
        """Adapters loaded on the engine (CPU pool or device slots)."""
        return list(await self._engine_call("list_loras"))

    # ------------------------------------------------------------------ shared behaviour
    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        deadline: float | None = None,
        pooling: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue a request; returns its delta stream.

        ``prompt`` may be text or token ids - a resumed request passes prompt + delivered tokens. ``priority``
        is the scheduling tier, lower runs first; ``deadline`` (``time.time()`` seconds) orders a tier's waiting
        requests earliest first. ``pooling`` ("last" or "mean") makes it an embedding request: one finished delta
        carrying ``embedding``. ``lora_request`` decodes it with that LoRA adapter (loaded on demand: a bad
        adapter fails the stream with a ``ValueError``). Raises ``ValueError`` at once for a request that can never
        run.
        """
        self._ensure_accepting()
        request = self._admit(
            EngineRequest.build(
                prompt,
                params,
                request_id=request_id,
                priority=priority,
                tenant=tenant,
                deadline=deadline,
                pooling=pooling,
                lora_request=lora_request,
            )
        )
        stream = self._open_stream(request.request_id, request.params.n)
        self._submit(request)
        return stream

    async def __aenter__(self) -> EngineFront:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream a request's deltas; leaving the loop early aborts the request."""
        stream = self.add_request(
            prompt, params, request_id=request_id, priority=priority, tenant=tenant, lora_request=lora_request
        )
        try:
            async for delta in stream:
                yield delta
        finally:
            if not stream.finished:
                self._abort_soon(stream.request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a delta whose ``finish_reason`` is ``"abort"``."""
        self._abort_soon(request_id)

    def _open_stream(self, request_id: str, num_choices: int = 1) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = RequestStream(request_id, num_choices)
        self._streams[request_id] = stream
        return stream

    def _deliver_kv_events(self, events: KVCacheEvents | None) -> None:
        """Hand a step's prefix-cache changes to the observers (on the event loop)."""
        if events is None:
            return
        for observer in self._kv_event_observers:
            observer(events)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        """Route a step's deltas to their streams (on the event loop)."""
        for observer in self._delta_observers:
            observer(deltas)
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            stream.put(delta)
            if stream.all_put:
                del self._streams[delta.request_id]

    def _fail_one(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        error = RuntimeError(f"engine loop failed: {exc!r}")
        error.__cause__ = exc
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
