"""``ProcessEngine``: the engine's step loop in a child process, so the serving process keeps its GIL.

With ``AsyncEngine`` the step loop is a thread of the serving process: every Python-level op of a step
competes for the GIL with the event loop that fetches from Kafka and writes to Redis, and each I/O hop
waits for the step thread to let go. Here the step loop is its own process (``process_main``), joined to
this front by a Unix socket pair (messages in ``process_wire``).

Requests are admitted (validated and tokenized) on the front's event loop (the front loads the same
tokenizer and learns the model's limits from ``EngineSpec``), so a request that can never run is refused at
once, as with ``AsyncEngine``. ``shutdown`` drains: the engine process aborts what is left and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from ..config import EngineConfig
from ..core.admission import RequestValidator
from ..core.request import EngineRequest
from ..outputs import EngineStats
from ..tokenizer import load_tokenizer
from .engine_front import ENGINE_CALLS, EngineFront
from .process_wire import EngineSpec, frame, split_frames

log = logging.getLogger(__name__)

#: The module the engine process runs (``python -m``); not imported here, so runpy finds it fresh.
ENGINE_PROCESS_MODULE = f"{__package__}.process_main"
#: How long ``shutdown`` waits for the engine process to abort its requests and exit before killing it.
STOP_TIMEOUT_S = 60.0


class _FrameProtocol(asyncio.Protocol):
    def __init__(self, on_message: Callable[[tuple[Any, ...]], None], on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for message in split_frames(self._buffer):
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()


class ProcessEngine(EngineFront):
    """Continuous-batching engine whose step loop runs in a child process.

    Same arguments as ``AsyncEngine(model, ...)`` (``EngineConfig`` fields, validated here at once), plus
    ``initializer``: a picklable callable the engine process runs before it loads the model (logging, torch
    threads). ``env``: variables added to the engine process's environment, in place before it imports torch (the
    OpenMP runtime reads its own, such as ``OMP_WAIT_POLICY``, only when it loads). ``start()`` returns once the
    model is loaded; a model that cannot load raises there.
    """

    def __init__(
        self,
        model: str,
        *,
        initializer: Callable[[], None] | None = None,
        env: Mapping[str, str] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        self.config = EngineConfig(model=model, **engine_kwargs)
        self._initializer = initializer
        self._extra_env = dict(env or {})
        self._process: asyncio.subprocess.Process | None = None
        self._transport: asyncio.Transport | None = None
        self._tokenizer: Any = None
        self._validator: RequestValidator | None = None
        self._spec: EngineSpec | None = None
        self._stats: EngineStats | None = None
        self._ready: asyncio.Future[EngineSpec] | None = None
        self._closed: asyncio.Future[None] | None = None
        self._stopping = False
        self._error: BaseException | None = None
        # Adapter calls awaiting the engine process's answer, by call id.
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call_id = 0

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("the engine is not started")
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        if self._spec is None:
            raise RuntimeError("the engine is not started")
        return self._spec.eos_token_ids

    @property
    def max_model_len(self) -> int:
        if self._spec is None:
            raise RuntimeError("the engine is not started")
        return self._spec.max_model_len

    @property
    def architecture(self) -> str | None:
        return self._spec.architecture if self._spec is not None else None

    @property
    def arithmetic(self) -> str | None:
        return (self._spec.arithmetic or None) if self._spec is not None else None

    @property
    def spec(self) -> EngineSpec | None:
        return self._spec

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before ``start``)."""
        return None if self._process is None else self._process.pid

    @property
    def is_running(self) -> bool:
        return (
            self._spec is not None
            and self._error is None
            and not self._stopping
            and self._closed is not None
            and not self._closed.done()
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine process failed: {self._error}") from self._error
        if self._process is not None:
            return
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                ENGINE_PROCESS_MODULE,
                "--fd",
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                env=_child_env() | self._extra_env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._ready = loop.create_future()
        self._closed = loop.create_future()
        self._transport, _ = await loop.create_unix_connection(
            partial(_FrameProtocol, self._on_message, self._on_lost), sock=ours
        )
        self._transport.write(frame(("init", self.config, self._initializer)))
        # The tokenizer loads here while the engine process loads the model.
        tokenizer_task = loop.run_in_executor(None, load_tokenizer, self.config.tokenizer_path)
        try:
            spec = await self._ready
            self._tokenizer = await tokenizer_task
        except BaseException:
            await self._reap(kill=True)
            with contextlib.suppress(BaseException):
                await tokenizer_task
            raise
        self._validator = RequestValidator(
            self._tokenizer, spec.vocab_size, spec.max_model_len, enable_lora=self.config.enable_lora,
            refused_tokens=spec.refused_tokens,
        )  # fmt: skip

    async def shutdown(self) -> None:
        """Stop the engine process; requests still in flight finish with ``finish_reason="abort"``."""
        if self._process is None:
            return
        if self.is_running and self._transport is not None:
            self._stopping = True
            self._transport.write(frame(("stop", None)))
        await self._reap(kill=False)

    async def _reap(self, kill: bool) -> None:
        process, closed = self._process, self._closed
        if process is None:
            return
        self._stopping = True
        if kill:
            _kill(process)
        if closed is not None and not closed.done():
            try:
                await asyncio.wait_for(asyncio.shield(closed), STOP_TIMEOUT_S)
            except TimeoutError:
                _kill(process)
        if self._transport is not None:
            self._transport.close()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            _kill(process)
            await process.wait()
        if self._streams:
            self._fail_all(RuntimeError("the engine process stopped"))

    # ------------------------------------------------------------------ requests
    def _ensure_accepting(self) -> None:
        if not self.is_running or self._validator is None or self._transport is None:
            raise RuntimeError(self._not_running_reason())

    def _admit(self, request: EngineRequest) -> EngineRequest:
        assert self._validator is not None  # ``_ensure_accepting`` passed
        return self._validator.admit(request)

    def _submit(self, request: EngineRequest) -> None:
        assert self._transport is not None
        # Admitted on this side: the engine process schedules it without tokenizing again.
        self._transport.write(frame(("add", request)))

    def _abort_soon(self, request_id: str) -> None:
        if self.is_running and self._transport is not None:
            self._transport.write(frame(("abort", request_id)))

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise RuntimeError("the engine is not started")
        return self._stats

    async def _engine_call(self, method: str, *args: Any) -> Any:
        if method not in ENGINE_CALLS:
            raise ValueError(f"unknown engine call {method!r}")
        self._ensure_accepting()
        assert self._transport is not None
        self._next_call_id += 1
        call_id = self._next_call_id
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._transport.write(frame(("call", (call_id, method, args))))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _fail_calls(self, error: BaseException) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    def _not_running_reason(self) -> str:
        if self._error is not None:
            return f"engine process failed: {self._error}"
        if self._spec is None:
            return "the engine is not started"
        return "the engine is stopped"

    # ------------------------------------------------------------------ messages from the engine process
    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "deltas":
            self._stats = message[2]
            self._deliver_kv_events(message[3])
            self._deliver(message[1])
        elif kind == "rejected":
            self._fail_one(message[1], ValueError(message[2]))
        elif kind == "answer":
            _, call_id, result, error = message
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
        elif kind == "ready":
            self._spec = message[1]
            self._stats = self._spec.stats
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(self._spec)
        elif kind == "stopped":
            self._stats = message[2]
            self._deliver(message[1])
        elif kind == "startup_failed":
            _, error_kind, text = message
            error: BaseException = (
                ValueError(text) if error_kind == "ValueError" else RuntimeError(f"{error_kind}: {text}")
            )
            self._error = error
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(error)
        elif kind == "failed":
            self._error = RuntimeError(f"the engine's step loop failed:\n{message[1]}")
            self._fail_all(self._error)
            self._fail_calls(self._error)

    def _on_lost(self) -> None:
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        if not self._stopping and self._error is None:
            self._error = RuntimeError("the engine process exited unexpectedly")
        if self._error is not None:
            log.error("engine.process_failed", extra={"pid": self.pid, "error": str(self._error)})
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(self._error or RuntimeError("the engine process exited before it was ready"))
        if self._error is not None and self._streams:
            self._fail_all(self._error)
        self._fail_calls(self._error or RuntimeError("the engine process stopped"))


def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()


def _child_env() -> dict[str, str]:
    """The front's environment, with its import path, so the engine process imports the same packages."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
