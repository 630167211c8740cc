"""Keeps the Kafka and Redis that ``sluicegate up`` started running, as its supervisor keeps its own services.

A local broker or Redis that exits (a developer's ``kill -9``, the out-of-memory killer) is started again with the
settings it had (``devstack.up``, which starts only what is missing), with a log line naming it. The services ride
out the gap as they would a real node's restart: workers keep their unsent events and re-append them, producers
retry. The local Redis keeps no append-only file, so what it held since its last snapshot is gone (a deployment
runs Redis with Sentinel, ``docs/reliability.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cli.backbone import devstack
from cli.backbone.kafka_cluster import node_layouts, running_pids
from cli.backbone.redis_server import redis_owner
from cli.stack.layout import StackLayout
from cli.stack.processes import running_pid
from sluicegate.settings import Settings


class BackboneWatch:
    """Looks every ``interval_s`` for a local Kafka node or Redis that has exited, and starts it again."""

    def __init__(
        self,
        settings: Settings,
        *,
        services: tuple[str, ...] = devstack.SERVICES,
        interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.settings = settings
        self.services = services
        self.interval_s = interval_s
        self.clock = clock
        self.say = say
        self.layout = StackLayout.of(settings)
        self.nodes = node_layouts(self.layout, settings.kafka_brokers)
        self._due = clock() + interval_s
        self.restarts = 0

    def dead(self) -> list[str]:
        """The services of the stack that are not running now ("redis", "kafka"); one that exited is collected
        on the way (``processes.alive`` polls this process's own children), not left a zombie."""
        gone = []
        if "redis" in self.services and running_pid(self.layout.redis_pid, redis_owner(self.layout)) is None:
            gone.append("redis")
        if "kafka" in self.services and any(pid is None for pid in running_pids(self.nodes)):
            gone.append("kafka")
        return gone

    def check(self) -> None:
        """When due: start again whatever exited. A start that fails is said and tried at the next check."""
        now = self.clock()
        if now < self._due:
            return
        self._due = now + self.interval_s
        gone = self.dead()
        if not gone:
            return
        names = " and ".join(gone)
        self.say(f"{names} exited; starting it again (see {self.layout.state})")
        try:
            # Only what exited: a Redis restart waits on no Kafka probe (whose failure would stop the Redis again).
            devstack.up(self.settings, services=tuple(gone))
        except Exception as exc:  # anything at all: `up` goes on, and the next check tries again
            self.say(f"{names} did not start again: {exc}; trying again in {self.interval_s:.0f} s")
            return
        self.restarts += 1
        self.say(f"{names} restarted")
