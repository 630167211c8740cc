"""The engine process that ``ProcessEngine`` starts (``python -m gpu_workers.engine.entrypoints.process_main``).

It builds the ``LLMEngine`` the front describes, answers with an ``EngineSpec``, then runs the step loop:
apply the front's adds and aborts, step while there is work, send each step's deltas back (see
``process_wire`` for the messages). It lives exactly as long as its socket: it ignores SIGINT and SIGTERM (the
front drains and then stops it) and exits when the front's end closes, however the front died.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

from ..outputs import RequestDelta
from .async_engine import CPU_DELIVERY_YIELD_S
from .engine_front import ENGINE_CALLS
from .process_wire import EngineSpec, frame, split_frames

_READ_CHUNK = 1 << 16


class _Channel:
    """The engine process's blocking end of the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()

    def send(self, message: tuple[Any, ...]) -> None:
        self.sock.sendall(frame(message))

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
            messages += split_frames(self._buffer)
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
                        engine.submit(payload)
                    except ValueError as exc:
                        self.channel.send(("rejected", payload.request_id, str(exc)))
                elif kind == "abort":
                    deltas += engine.abort(payload)
                elif kind == "call":
                    self._answer(*payload)
            if engine.has_unfinished():
                deltas += engine.step()
            kv_events = engine.take_kv_events()
            if deltas or kv_events is not None:
                self.channel.send(("deltas", deltas, engine.stats(), kv_events))
                if self.delivery_yield_s:
                    time.sleep(self.delivery_yield_s)

    def _answer(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        """Run an adapter call between steps and answer it; its ValueError (a LoRAError) goes back as it is."""
        result: Any = None
        error: BaseException | None = None
        try:
            if method not in ENGINE_CALLS:
                raise ValueError(f"unknown engine call {method!r}")
            result = getattr(self.engine, method)(*args)
        except ValueError as exc:
            error = exc
        except Exception as exc:  # reported to the caller as text: its class may not pickle
            error = RuntimeError(f"{type(exc).__name__}: {exc}")
        self.channel.send(("answer", call_id, result, error))


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
        from ..llm_engine import LLMEngine

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
        refused_tokens=engine.validator.refused_tokens,
        architecture=engine.architecture,
        arithmetic=engine.arithmetic,
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
    sys.exit(main())
