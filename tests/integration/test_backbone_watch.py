"""``sluicegate up`` keeps the local Redis (and Kafka) it started running: one killed with ``kill -9`` is started
again on its port by the next check, with a line saying so, and answers; nothing else is touched. A real
``redis-server`` under ``devstack``, on a port and state folder of this test's own."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis
from needs import require_tool
from ports import free_port

from cli.backbone import devstack
from cli.stack.backbone_watch import BackboneWatch
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_killed_local_redis_is_started_again(tmp_path: Path) -> None:
    require_tool("redis-server", "apt-get install redis-server")
    settings = Settings(state_dir=tmp_path / "state", redis_port=free_port())
    info = devstack.up(settings, services=("redis",))
    lines: list[str] = []
    watch = BackboneWatch(settings, services=("redis",), interval_s=0.0, say=lines.append)
    try:
        watch.check()
        assert lines == [] and watch.restarts == 0  # all running: nothing said, nothing started
        assert info.redis_pid is not None
        os.kill(info.redis_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while watch.dead() != ["redis"]:
            assert time.monotonic() < deadline, "the killed Redis still looks alive"
            time.sleep(0.05)
        watch.check()
        assert (
            watch.restarts == 1
            and lines[0].startswith("redis exited; starting it again")
            and lines[1] == ("redis restarted")
        ), lines
        assert redis.Redis.from_url(info.redis_url).ping()
        assert watch.dead() == []
        # The killed one was this process's child: collected, not left a zombie.
        stat = Path(f"/proc/{info.redis_pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    finally:
        devstack.down(settings, services=("redis",))
