"""Runs a service's main coroutine on uvloop when it is installed (cheaper event-loop turns), else on asyncio's."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a uvloop loop when uvloop imports (uvicorn's ``standard`` extra installs it)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
