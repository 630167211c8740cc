"""``ProcessEngine``: the engine's step loop in a child process, so the serving process keeps its GIL.

With ``AsyncEngine`` the step loop is a thread of the serving process: every Python-level op of a step
competes for the GIL with the event loop that fetches from Kafka and writes to Redis, and each I/O hop
waits for the step thread to let go. Here the step loop is its own process (``python -m
gpu_workers.engine.entrypoints.process_engine``), joined to the front by a Unix socket pair carrying length-prefixed
pickles:

* front -> engine: ``("init", config, initializer)`` once, then ``("add", EngineRequest)``,
  ``("abort", request_id)`` and ``("stop", None)``;
* engine -> front: ``("ready", EngineSpec)`` or ``("startup_failed", kind, message)``; then per step
  ``("deltas", [RequestDelta], EngineStats)``, ``("rejected", request_id, message)`` for an add the engine
  refuses, ``("failed", traceback)`` when the step loop dies, and ``("stopped", [RequestDelta], EngineStats)``
  as the answer to ``stop``.

Requests are validated and tokenized on the front's event loop (the front loads the same tokenizer and
learns the model's limits from ``EngineSpec``), so a request that can never run is refused at once, as
with ``AsyncEngine``. The engine process lives exactly as long as its socket: it ignores SIGINT and
SIGTERM (the front drains and then stops it) and exits when the front's end closes, however the front died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..config import EngineConfig
from ..core.admission import EngineRequest, PromptInput, RequestValidator
from ..outputs import EngineStats, RequestDelta
from ..sampling_params import SamplingParams
from ..tokenizer import load_tokenizer
from .async_engine import CPU_DELIVERY_YIELD_S
from .engine_front import EngineFront, RequestStream

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_READ_CHUNK = 1 << 16
#: How long ``shutdown`` waits for the engine process to abort its requests and exit before killing it.
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EngineSpec:
    """What the front needs to know of the loaded model, sent once the engine is ready."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    attention_backend: str
    pid: int
    stats: EngineStats


def _frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _split_frames(buffer: bytearray) -> list[tuple[Any, ...]]:
    """Take every complete frame off the front of ``buffer``."""
    messages = []
    start = 0
    while len(buffer) - start >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer, start)
        end = start + _HEADER.size + size
        if len(buffer) < end:
            break
        messages.append(pickle.loads(memoryview(buffer)[start + _HEADER.size : end]))
        start = end
    del buffer[:start]
    return messages


# --- the engine process -----------------------------------------------------------------------------------


class _Channel:
    """The engine process's blocking end of the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def send(self, message: tuple[Any, ...]) -> None:
        self.sock.sendall(_frame(message))

    def receive(self, block: bool) -> list[tuple[Any, ...]] | None:
        """Messages that arrived (waiting for at least one when ``block``); None once the front has gone."""
        messages: list[tuple[Any, ...]] = []
        wait: float | None = None if block else 0.0
        while True:
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                return messages
            chunk = self.sock.recv(_READ_CHUNK)
            if not chunk:
                return None
            self._buffer += chunk
            messages += _split_frames(self._buffer)
            # Keep reading while more is there, but never wait once a whole message arrived (a partial one
            # is waited for: its sender writes whole frames, so the rest is already on its way).
            wait = 0.0 if messages and not self._buffer else None


class _StepLoop:
    """Applies the front's commands and steps the engine while it has work."""

    def __init__(self, engine: Any, channel: _Channel) -> None:
        self.engine = engine
        self.channel = channel
        # On CPU the next step would compete for a core with the worker that just got the deltas and with
        # Redis and the relay behind it: give them the head start (see ``CPU_DELIVERY_YIELD_S``).
        self.delivery_yield_s = CPU_DELIVERY_YIELD_S if engine.config.device.type == "cpu" else 0.0

    def run(self) -> None:
        engine = self.engine
        while True:
            commands = self.channel.receive(block=not engine.has_unfinished())
            if commands is None:  # the front is gone: nobody is left to serve
                return
            deltas: list[RequestDelta] = []
            for kind, payload in commands:
                if kind == "stop":
                    deltas += engine.abort_all()
                    self.channel.send(("stopped", deltas, engine.stats()))
                    return
                if kind == "add":
                    try:
                        engine.add_sequence(engine.sequence_for(payload))
                    except ValueError as exc:
                        self.channel.send(("rejected", payload.request_id, str(exc)))
                elif kind == "abort":
                    delta = engine.abort_request(payload)
                    if delta is not None:
                        deltas.append(delta)
            if engine.has_unfinished():
                deltas += engine.step()
            if deltas:
                self.channel.send(("deltas", deltas, engine.stats()))
                if self.delivery_yield_s:
                    time.sleep(self.delivery_yield_s)


def serve(sock: socket.socket) -> int:
    """The engine process: build the engine the front describes, then run its step loop."""
    # The front decides when the engine stops: a Ctrl-C or SIGTERM sent to the whole process group must not
    # kill the engine under requests the front is still draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = _Channel(sock)
    first = channel.receive(block=True)
    if not first or first[0][0] != "init":
        return 2
    _, config, initializer = first[0]
    try:
        if initializer is not None:
            initializer()
        from ..core.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except Exception as exc:
        channel.send(("startup_failed", "ValueError" if isinstance(exc, ValueError) else type(exc).__name__, str(exc)))
        return 1
    # The model, tokenizer and libraries live as long as the process: keep them out of every GC pass.
    gc.collect()
    gc.freeze()
    spec = EngineSpec(
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        eos_token_ids=frozenset(engine.eos_token_ids),
        attention_backend=engine.attention_backend_name,
        pid=os.getpid(),
        stats=engine.stats(),
    )
    channel.send(("ready", spec))
    try:
        _StepLoop(engine, channel).run()
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the front went away mid-send
    except BaseException:
        with contextlib.suppress(OSError):
            channel.send(("failed", traceback.format_exc()))
        raise
    return 0


# --- the front --------------------------------------------------------------------------------------------


class _FrameProtocol(asyncio.Protocol):
    def __init__(self, on_message: Callable[[tuple[Any, ...]], None], on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        for message in _split_frames(self._buffer):
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()


class ProcessEngine(EngineFront):
    """Continuous-batching engine whose step loop runs in a child process.

    Same arguments as ``AsyncEngine(model, ...)`` (``EngineConfig`` fields, validated here at once), plus
    ``initializer``: a picklable callable the engine process runs before it loads the model (logging, torch
    threads). ``start()`` returns once the model is loaded; a model that cannot load raises there.
    """

    def __init__(self, model: str, *, initializer: Callable[[], None] | None = None, **engine_kwargs: Any) -> None:
        super().__init__()
        self.config = EngineConfig(model=model, **engine_kwargs)
        self._initializer = initializer
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
                __name__,
                "--fd",
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                env=_child_env(),
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
        self._transport.write(_frame(("init", self.config, self._initializer)))
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
        self._validator = RequestValidator(self._tokenizer, spec.vocab_size, spec.max_model_len)

    async def shutdown(self) -> None:
        """Stop the engine process; requests still in flight finish with ``finish_reason="abort"``."""
        if self._process is None:
            return
        if self.is_running and self._transport is not None:
            self._stopping = True
            self._transport.write(_frame(("stop", None)))
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
    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: str = "standard",
        tenant: str = "default",
    ) -> RequestStream:
        if not self.is_running or self._validator is None or self._transport is None:
            raise RuntimeError(self._not_running_reason())
        request: EngineRequest = self._validator.validate(
            prompt, params, request_id=request_id, priority=priority, tenant=tenant
        )
        stream = self._open_stream(request.request_id)
        self._transport.write(_frame(("add", request)))
        return stream

    def _abort_soon(self, request_id: str) -> None:
        if self.is_running and self._transport is not None:
            self._transport.write(_frame(("abort", request_id)))

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise RuntimeError("the engine is not started")
        return self._stats

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
            self._deliver(message[1])
        elif kind == "rejected":
            self._fail_one(message[1], ValueError(message[2]))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sluicegate engine process (started by ProcessEngine).")
    parser.add_argument("--fd", type=int, required=True, help="the inherited socket to the front")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    try:
        code = serve(sock)
    finally:
        sock.close()
    # Skip interpreter teardown: the frozen heap would only be walked to report extension objects still
    # alive (nanobind prints pages of "leaked" lines for triton's), and nothing is left to flush but stdio.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # Run the package's module, not this ``__main__`` copy: what the engine process pickles (``EngineSpec``)
    # must name classes the front can import.
    from gpu_workers.engine.entrypoints import process_engine

    sys.exit(process_engine.main())
