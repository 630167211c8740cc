"""Stopping background tasks: cancel them and wait until each has really ended.

On Python 3.11, ``asyncio.wait_for`` returns the wrapped awaitable's result when the cancellation of the task
awaiting it arrives in the same loop turn as that result (CPython gh-86296, fixed in 3.12 by building
``wait_for`` on ``asyncio.timeout``). redis-py wraps every command it writes in ``wait_for`` when the client has a
``socket_timeout``, as the services' clients do, and aiokafka uses ``wait_for`` too. So a loop task cancelled
while it sends a Redis command can lose the cancellation and go on looping, and a ``close()`` that cancels it
once and awaits it waits forever (a test's teardown hung until its 120 s timeout on the ingress's response
sweeper). :func:`cancel_and_wait` cancels again any task still running after a short wait.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: How long a cancelled task gets to end before it is cancelled again. Longer than any loop's clean-up after
#: a cancellation (none of them awaits much), so a second cancellation only meets a lost first one.
RECANCEL_AFTER_S = 0.5


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, recancel_after_s: float = RECANCEL_AFTER_S) -> None:
    """Cancel ``tasks`` (None skipped) and return once every one has ended, whatever it ended with.

    Their outcomes are retrieved and dropped: callers stop background work, they do not want its result. If the
    caller is cancelled meanwhile, that propagates (every task has been cancelled at least once).
    """
    started = [task for task in tasks if task is not None]
    pending = {task for task in started if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_after_s)
    for task in started:
        if not task.cancelled():
            task.exception()  # read, so a failure is not reported as "never retrieved"
