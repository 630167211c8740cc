"""Online API: an asyncio front over ``LLMEngine`` whose step loop runs in its own thread.

Requests and aborts travel to the step thread through a thread-safe queue; deltas come back onto
the event loop with ``loop.call_soon_threadsafe``, one callback per step. The event loop never
waits on the model: only validation and tokenization of a new prompt run on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any

from ..config import EngineConfig
from ..core.request import EngineRequest
from ..llm_engine import LLMEngine
from ..outputs import EngineStats
from .engine_front import ENGINE_CALLS, EngineFront, RequestStream

__all__ = ["AsyncEngine", "RequestStream"]

_STOP = "stop"
_ADD = "add"
_ABORT = "abort"
_CALL = "call"

#: After posting a step's deltas, a CPU engine's step loop sleeps this long, so the deltas' way out (the event
#: loop's hop to the Redis append, then Redis and the relay) gets the CPU before the next step does.
#: In a thread: the model runs as a string of short GIL-releasing ops, and a thread that keeps re-taking the
#: GIL that quickly starves the event loop (each hop from delta to Redis append waits for a forced switch);
#: the pause hands the GIL over once. Measured on the pipeline benchmark (2-core box, 10 req/s): first token
#: -> XADD p50 2.0-2.1 ms without, 0.5 ms with. In an engine process it keeps the next step off the cores
#: the worker, Redis and the relay need (emit + relay p50 1.6-1.7 -> 1.4 ms in paired runs). A CUDA step
#: waits on the GPU with the GIL released and has cores to spare, so it does not pause.
CPU_DELIVERY_YIELD_S = 1e-4


class AsyncEngine(EngineFront):
    """Continuous-batching engine for asyncio servers.

    Build it from a model folder (same keyword arguments as ``LLM``) or around an existing
    ``LLMEngine``; use ``async with`` or ``start()``/``shutdown()``.
    """

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **engine_kwargs: Any) -> None:
        if engine is None:
            if model is None:
                raise ValueError("AsyncEngine needs a model path or an LLMEngine")
            engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        elif model is not None or engine_kwargs:
            raise ValueError("pass either an LLMEngine or model arguments, not both")
        super().__init__()
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._delivery_yield_s = CPU_DELIVERY_YIELD_S if engine.config.device.type == "cpu" else 0.0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def architecture(self) -> str | None:
        return self.engine.architecture

    @property
    def arithmetic(self) -> str | None:
        return self.engine.arithmetic

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine loop failed: {self._error!r}") from self._error
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sluicegate-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step thread; requests still in flight finish with ``finish_reason="abort"``."""
        thread = self._thread
        if thread is None:
            return
        self._commands.put((_STOP, None))
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._thread = None
        # The thread is gone, so touching the engine from here is safe.
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == _ADD:
                try:
                    self.engine.submit(payload)
                except ValueError as exc:  # e.g. its LoRA adapter cannot load
                    self._fail_one(payload.request_id, exc)
            elif kind == _CALL:
                self._answer(*payload)
        self._deliver(self.engine.abort_all())
        self._stats = self.engine.stats()

    # ------------------------------------------------------------------ requests
    def _ensure_accepting(self) -> None:
        self._ensure_started()

    def _admit(self, request: EngineRequest) -> EngineRequest:
        return self.engine.admit(request)

    def _submit(self, request: EngineRequest) -> None:
        self._commands.put((_ADD, request))

    def _abort_soon(self, request_id: str) -> None:
        self._commands.put((_ABORT, request_id))

    def stats(self) -> EngineStats:
        return self._stats

    async def _engine_call(self, method: str, *args: Any) -> Any:
        if method not in ENGINE_CALLS:
            raise ValueError(f"unknown engine call {method!r}")
        self._ensure_started()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.put((_CALL, (method, args, future)))
        return await future

    # ------------------------------------------------------------------ step thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._drain_commands(block=not engine.has_unfinished()):
                    return
                if engine.has_unfinished():
                    deltas = engine.step()
                    kv_events = engine.take_kv_events()
                    if kv_events is not None:
                        self._post(self._deliver_kv_events, kv_events)
                    if deltas:
                        self._post(self._deliver, deltas)
                        if self._delivery_yield_s:
                            time.sleep(self._delivery_yield_s)
                self._stats = engine.stats()
        except BaseException as exc:  # the loop must report any failure to every waiting stream
            self._error = exc
            self._post(self._fail_all, exc)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; False when asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, payload = command
            if kind == _STOP:
                return False
            if kind == _ADD:
                try:
                    self.engine.submit(payload)
                except ValueError as exc:
                    self._post(self._fail_one, payload.request_id, exc)
            elif kind == _ABORT:
                aborted = self.engine.abort(payload)
                if aborted:
                    self._post(self._deliver, aborted)
            elif kind == _CALL:
                self._answer(*payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _answer(self, method: str, args: tuple[Any, ...], future: asyncio.Future[Any]) -> None:
        """Run an engine call on the step thread and settle its future on the event loop."""
        try:
            result = getattr(self.engine, method)(*args)
        except Exception as exc:  # the caller gets it (a LoRAError for a bad adapter); the loop goes on
            self._post(_settle, future, None, exc)
        else:
            self._post(_settle, future, result, None)

    def _post(self, callback: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        # The loop may be closed if the application exits without shutdown().
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
