"""A pytest plugin: when pytest-timeout stops a test, it also prints every asyncio task's stack.

pytest-timeout dumps the threads' stacks, which for an async test only shows the event loop waiting in
``select``; the task that never finished (a fixture's teardown awaiting a close that hangs) stays hidden.
This wraps the SIGALRM handler pytest-timeout installs so the running loop's tasks are printed first.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import io
import signal
import sys
from collections.abc import Generator, Iterator
from types import FrameType
from typing import Any

import pytest


def _awaiting(coro: Any) -> Iterator[str]:
    """Where a coroutine and everything it awaits stand, outermost first (Task.print_stack shows only the
    outermost frame)."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            yield f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        awaited = (
            getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
        )
        if awaited is not None and type(awaited).__name__ == "async_generator_asend":
            # An async generator's __anext__ (a fixture's teardown): its only reference is the generator itself.
            awaited = next((r for r in gc.get_referents(awaited) if inspect.isasyncgen(r)), None)
        coro = awaited


def _task_stacks(loop: asyncio.AbstractEventLoop) -> str:
    out = io.StringIO()
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        out.write(f"--- task {task.get_name()}\n")
        out.writelines(f"{line}\n" for line in _awaiting(task.get_coro()))
    return out.getvalue()


@pytest.hookimpl(wrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Generator[None, Any, Any]:
    result = yield
    if getattr(settings, "method", None) != "signal":
        return result
    original = signal.getsignal(signal.SIGALRM)
    if not callable(original):
        return result

    def report_then_fail(signum: int, frame: FrameType | None) -> None:
        loop = asyncio._get_running_loop()  # the loop this (main) thread is running, if any
        if loop is not None:
            sys.stdout.write(f"{'~' * 20} asyncio tasks at the timeout {'~' * 20}\n{_task_stacks(loop)}")
            sys.stdout.flush()
        original(signum, frame)

    signal.signal(signal.SIGALRM, report_then_fail)
    return result
