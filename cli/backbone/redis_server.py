"""The local Redis: find (or, as root on Debian, install) ``redis-server`` and start it in the background on
``redis_port``, bound to 127.0.0.1, with its data and log under the state folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from cli.stack.layout import DevStackError, StackLayout
from cli.stack.processes import Owner, log, spawn

REDIS_START_TIMEOUT_S = 15.0
REDIS_STOP_TIMEOUT_S = 10.0
REDIS_HINT = "install it (apt-get install redis-server, or brew install redis)"


def find_redis_server() -> str:
    """``redis-server`` on the PATH; as root with apt-get, installed first when missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise DevStackError(f"redis-server not found: {REDIS_HINT}")
    log.info("devstack.installing package=redis-server via=apt-get")
    # RUNLEVEL=1 keeps the package's init script from starting a system Redis on port 6379.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    found = shutil.which("redis-server")
    if found is None:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise DevStackError(f"redis-server not found and `apt-get install redis-server` failed: {reason}")
    return found


def redis_owner(layout: StackLayout) -> Owner:
    """Recognises this instance's server by its binary and its port."""
    port = str(layout.redis_port)
    # redis-server rewrites its title to "redis-server 127.0.0.1:<port>" once started.
    return lambda tokens: (
        any("redis-server" in t for t in tokens) and any(t == port or t.endswith(f":{port}") for t in tokens)
    )


def start_redis(layout: StackLayout, server: str) -> int:
    """Start ``server`` for this instance; returns its pid (not yet ready)."""
    data = layout.redis_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [
        server,
        "--port",
        str(layout.redis_port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data),
        "--daemonize",
        "no",
        "--appendonly",
        "no",
        "--save",
        "900 1",
    ]
    pid = spawn(cmd, layout.redis_log, layout.redis_dir, layout.redis_pid)
    log.info("devstack.redis_spawned pid=%d url=%s", pid, layout.redis_url)
    return pid
