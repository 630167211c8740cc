"""Background processes of the local stack: pid files, the state-folder lock, liveness checks, starting a
service in its own session and stopping it (SIGTERM, wait, SIGKILL). POSIX only (process groups, flock,
/proc where present).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("sluicegate.devstack")  # one logger for the whole dev stack, also under `python -m`

T = TypeVar("T")

#: Tells whether a process's command line (split on spaces) is the service a pid file names.
Owner = Callable[[list[str]], bool]

# Children started by this process, so their exit status is collected (a zombie still has a pid).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@contextlib.contextmanager
def locked(state: Path) -> Iterator[None]:
    """Serialise up/down/fetch across processes (parallel test workers, two terminals)."""
    state.mkdir(parents=True, exist_ok=True)
    with open(state / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_coro(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.3)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _cmdline_tokens(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").split()


def alive(pid: int, owns: Owner) -> bool:
    """True when ``pid`` runs (not a zombie) and its command line is the service we expect, so a
    recycled pid from an old pid file is never mistaken for our process."""
    child = _CHILDREN.get(pid)
    if child is not None:
        # Our own unreaped child cannot have its pid recycled, so poll() is the whole answer. Its command
        # line is not: redis-server rewrites its title just after starting, and a read of
        # /proc/<pid>/cmdline in that moment matches nothing.
        if child.poll() is None:
            return True
        _CHILDREN.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process: not ours
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError):
            if stat.read_text().rpartition(")")[2].split()[0] == "Z":
                return False
        tokens = _cmdline_tokens(pid)
        return tokens is not None and owns(tokens)
    return True  # no /proc (macOS): trust the pid file


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def running_pid(pid_file: Path, owns: Owner) -> int | None:
    """Our live pid for a service, cleaning a stale pid file on the way."""
    pid = _read_pid(pid_file)
    if pid is not None and alive(pid, owns):
        return pid
    if pid_file.exists():
        log.info("devstack.stale_pid_file file=%s pid=%s", pid_file, pid)
        pid_file.unlink(missing_ok=True)
    return None


def _tail(path: Path, lines: int = 200) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            return handle.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def last_problem(*paths: Path) -> str:
    """The most telling line of a failed start: the last ERROR/FATAL/Exception line, else the last line."""
    for path in paths:
        lines = [line.strip() for line in _tail(path) if line.strip()]
        for line in reversed(lines):
            if re.search(r"\b(ERROR|FATAL|Exception|Error:|# )", line):
                return line[:300]
        if lines:
            return lines[-1][:300]
    return "no log output"


def spawn(cmd: list[str], log_path: Path, cwd: Path, pid_file: Path) -> int:
    """Start ``cmd`` in the background with its output appended to ``log_path``; writes and returns its pid."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        # A new session: the service outlives the CLI and ignores the terminal's Ctrl-C.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    _CHILDREN[proc.pid] = proc
    pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


@dataclass(frozen=True)
class Running:
    """One of our live services: its pid, pid file, how to recognise it, and how long a clean stop may take."""

    pid: int
    pid_file: Path
    owns: Owner
    stop_timeout_s: float


def stop(services: dict[str, Running]) -> None:
    """SIGTERM every service, wait for each (controlled shutdown), SIGKILL what is left."""
    for name, service in services.items():
        log.info("devstack.stopping service=%s pid=%d", name, service.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(service.pid, signal.SIGTERM)
    for name, service in services.items():
        pid = service.pid
        started = time.monotonic()
        deadline = started + service.stop_timeout_s
        while alive(pid, service.owns) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid, service.owns):
            log.warning("devstack.kill service=%s pid=%d after_s=%.0f", name, pid, service.stop_timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            child = _CHILDREN.get(pid)
            if child is not None:
                child.wait(timeout=10)
        _CHILDREN.pop(pid, None)
        service.pid_file.unlink(missing_ok=True)
        log.info("devstack.stopped service=%s pid=%d elapsed_s=%.2f", name, pid, time.monotonic() - started)
