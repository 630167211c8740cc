"""Redis servers of a test's or a benchmark's own for failover work: :class:`RedisPair` (a ``redis-server``
primary and its replica) and :class:`SentinelSet` (the pair plus three ``redis-sentinel`` processes watching the
primary), all on free ports of this machine (or consecutive ports from a given one), bound to the loopback or to
another address of the machine (``host``: then reachable from other network namespaces, without Redis's protected
mode), without persistence, each in its own session so a signal to one never reaches the caller. Debian's
``redis-server`` and ``redis-sentinel`` packages provide the binaries.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from redis.exceptions import RedisError

from benchmarks.common import free_port
from sluicegate.redis_client import create_redis

SERVICE = "sluicegate-primary"
LOOPBACK = "127.0.0.1"


def have_binaries() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-sentinel") is not None


class RedisPair:
    """A ``redis-server`` primary and a replica of it, on ``host``; ports from ``first_port`` up when given."""

    def __init__(self, folder: Path, host: str = LOOPBACK, first_port: int | None = None) -> None:
        self.folder = folder
        self.host = host
        self._next_port = first_port
        self.ports: dict[str, int] = {"primary": self._port(), "replica": self._port()}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def _port(self) -> int:
        if self._next_port is None:
            return free_port()
        self._next_port += 1
        return self._next_port - 1

    @property
    def _open_args(self) -> list[str]:
        # Off the loopback, Redis refuses password-less clients unless protected mode is off; and a replica names
        # itself by the address its connection came from, which the kernel may take from another address of the
        # same interface: it must announce the one it listens on.
        return [] if self.host == LOOPBACK else ["--protected-mode", "no", "--replica-announce-ip", self.host]

    def node_url(self, name: str) -> str:
        return f"redis://{self.host}:{self.ports[name]}/0"

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.folder / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise FileNotFoundError("redis-server is needed (apt-get install redis-server)")
        for name in ("primary", "replica"):
            data = self.folder / name
            data.mkdir()
            args = [server, "--port", str(self.ports[name]), "--bind", self.host, "--save", "", "--dir", str(data)]
            args += self._open_args
            if name == "replica":
                args += ["--replicaof", self.host, str(self.ports["primary"])]
            self._spawn(name, args)

    async def synced(self, timeout_s: float = 20.0) -> None:
        """Until the primary lists the replica as online."""
        client = create_redis(url=self.node_url("primary"), socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError, RedisError):  # not up yet
                    if (await client.info("replication")).get("slave0", {}).get("state") == "online":
                        return
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()
        raise TimeoutError("the replica never came online")

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.processes[name].pid, sig)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.processes[name].wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()  # SIGKILL also ends a SIGSTOPped server
                process.wait(timeout=10)


@contextlib.contextmanager
def redis_pair() -> Iterator[RedisPair]:
    with tempfile.TemporaryDirectory(prefix="sluicegate-redis-pair-") as folder:
        pair = RedisPair(Path(folder))
        try:
            pair.start()
            yield pair
        finally:
            pair.stop()


class SentinelSet(RedisPair):
    """The pair plus three Sentinels (quorum 2, ``down-after-milliseconds`` 1000) watching the primary as
    :data:`SERVICE`; :attr:`url` is the ``redis+sentinel://`` URL of all three."""

    def __init__(self, folder: Path, host: str = LOOPBACK, first_port: int | None = None) -> None:
        super().__init__(folder, host, first_port)
        self.ports |= {f"sentinel{i}": self._port() for i in range(3)}

    @property
    def url(self) -> str:
        hosts = ",".join(f"{self.host}:{self.ports[f'sentinel{i}']}" for i in range(3))
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        super().start()
        sentinel = shutil.which("redis-sentinel")
        if sentinel is None:
            raise FileNotFoundError("redis-sentinel is needed (apt-get install redis-sentinel)")
        for i in range(3):
            name = f"sentinel{i}"
            conf = self.folder / f"{name}.conf"  # a Sentinel rewrites its config file: one each
            conf.write_text(
                f"port {self.ports[name]}\nbind {self.host}\ndir {self.folder}\n"
                + ("" if self.host == LOOPBACK else f"protected-mode no\nsentinel announce-ip {self.host}\n")
                + f"sentinel monitor {SERVICE} {self.host} {self.ports['primary']} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
            )
            self._spawn(name, [sentinel, str(conf)])

    async def replica_in_sync(self, timeout_s: float = 30.0) -> None:
        """Until the Sentinels know the replica (so they can promote it) and it has synced."""
        client = create_redis(url=f"redis://{self.host}:{self.ports['sentinel0']}/0", socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(RedisError, OSError):
                    # One dict per replica (a Sentinel refreshes a replica's link state every few seconds).
                    replicas = await client.execute_command("SENTINEL", "REPLICAS", SERVICE)
                    if any(r.get(b"master-link-status") == b"ok" for r in replicas or []):
                        return
                await asyncio.sleep(0.2)
        finally:
            await client.aclose()
        raise TimeoutError("the Sentinels never saw a synced replica")
