"""cancel_and_wait: a loop whose cancellation is lost (as Python 3.11's wait_for loses one) is still stopped."""

from __future__ import annotations

import asyncio
import sys

import pytest

from sluicegate.task_stop import cancel_and_wait


async def _written() -> int:
    return 1  # a Redis command's write that completes at once


async def _sending_loop(turns: list[int]) -> None:
    """What a loop over redis-py commands with a socket timeout does on every turn."""
    while True:
        await asyncio.wait_for(_written(), 10)
        turns.append(1)
        await asyncio.sleep(0)


async def _cancelled_in_the_write(turns: list[int]) -> asyncio.Task[None]:
    task = asyncio.create_task(_sending_loop(turns))
    await asyncio.sleep(0)  # the loop is now awaiting wait_for, its write scheduled just before this line
    task.cancel()
    return task


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's wait_for delivers the cancellation")
async def test_python_311_wait_for_loses_a_cancellation() -> None:
    turns: list[int] = []
    task = await _cancelled_in_the_write(turns)
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done and turns, "the loop went on after its cancellation"
    await cancel_and_wait(task)


async def test_a_loop_that_lost_its_cancellation_is_stopped() -> None:
    turns: list[int] = []
    task = await _cancelled_in_the_write(turns)
    await asyncio.wait_for(cancel_and_wait(task, recancel_after_s=0.05), 5)
    assert task.cancelled()


async def test_a_task_that_swallows_cancellations_is_cancelled_until_it_ends() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while swallowed < 3:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
        raise RuntimeError("ended on the fourth")

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel_after_s=0.02), 5)
    assert swallowed == 3 and isinstance(task.exception(), RuntimeError)


async def test_finished_and_missing_tasks_are_fine() -> None:
    finished = asyncio.create_task(_written())
    await finished
    failed = asyncio.create_task(asyncio.sleep(-1, result=None))
    await failed
    await cancel_and_wait(finished, None, failed)
    assert finished.result() == 1
