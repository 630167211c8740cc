"""A redis-server of a test's own, on a free port: for tests that kill it, restart it, or change its
server-wide configuration, which on the session's shared Redis would reach every other test running beside them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from needs import require_tool
from ports import free_port


class RedisServer:
    """A redis-server of this test's own on a free port, so it can be killed and restarted safely."""

    def __init__(self, data_dir: Path, appendonly: bool) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        server = require_tool("redis-server", "apt-get install redis-server")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.data_dir)]
        self.process = subprocess.Popen(
            [server, *args, *persistence],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), _socket_to(self.port):
                return
            time.sleep(0.05)
        raise AssertionError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@contextlib.contextmanager
def _socket_to(port: int) -> Iterator[None]:
    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        yield


@contextlib.contextmanager
def private_redis(data_dir: Path) -> Iterator[RedisServer]:
    """A started redis-server without persistence, killed on the way out."""
    server = RedisServer(data_dir, appendonly=False)
    server.start()
    try:
        yield server
    finally:
        server.kill()
