"""Services run their main coroutine on uvloop when it is installed."""

from __future__ import annotations

import asyncio

import pytest
from needs import require_import

from sluicegate import event_loop


def test_run_returns_the_result_on_a_uvloop_loop() -> None:
    require_import("uvloop")

    async def main() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(main()).startswith("uvloop")


def test_run_propagates_the_coroutine_s_exception() -> None:
    async def main() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        event_loop.run(main())
