"""Keeps the processes of ``sluicegate up`` running, as a compose restart policy or Kubernetes would.

A child that exits (the out-of-memory killer took a worker, a crash) is started again after a backoff that
doubles with each exit inside the crash window (1 s, 2 s, 4 s ... at most 30 s), with a log line naming it; its
requests resume on the restarted process (Kafka re-delivers what it had not finished). Only repeated exits
(``max_crashes`` within ``window_s``) stop the stack: :meth:`Supervisor.check` then raises :class:`CrashLoop`
naming the child and its log. Each child runs in a session of its own, so Ctrl-C reaches ``up`` once and
``up`` stops the children in order; once a child has exited, whatever it left in its process group (a Celery
worker's embedded beat after the worker was killed) is killed too, so no process outlives the stack.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: What a child runs: this prefix plus its own arguments (the stack's CLI by default).
CLI = (sys.executable, "-m", "cli.main")


class CrashLoop(RuntimeError):
    """A child kept exiting: the message names it, how often, and its log."""


@dataclass
class Child:
    """One supervised process: what it runs, where it logs, and its recent exits."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes]
    exits: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float | None = None
    restarts: int = 0

    @property
    def running(self) -> bool:
        return self.restart_at is None and self.process.poll() is None


class Supervisor:
    """Starts children, restarts the ones that exit, and stops them all."""

    def __init__(
        self,
        log_dir: Path,
        *,
        command: tuple[str, ...] = CLI,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_crashes: int = 5,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.log_dir = log_dir
        self.command = command
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_crashes = max_crashes
        self.window_s = window_s
        self.clock = clock
        self.say = say
        self.children: list[Child] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        """Start ``name`` and supervise it from now on."""
        log_path = self.log_dir / f"{name}.log"
        child = Child(name, args, env, log_path, self._popen(args, env, log_path))
        self.children.append(child)
        return child

    def _popen(self, args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log_file:
            return subprocess.Popen(
                [*self.command, *args],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches `up` once; it stops the children in order
            )

    def check(self) -> None:
        """Note exits, schedule restarts with backoff, start what is due; raise :class:`CrashLoop` when a child
        exited ``max_crashes`` times within ``window_s``."""
        now = self.clock()
        for child in self.children:
            if child.restart_at is None:
                code = child.process.poll()
                if code is None:
                    continue
                _kill_leftovers(child.process)
                child.exits.append(now)
                while child.exits and now - child.exits[0] > self.window_s:
                    child.exits.popleft()
                if len(child.exits) >= self.max_crashes:
                    raise CrashLoop(
                        f"{child.name} exited {len(child.exits)} times within {self.window_s:.0f} s (last exit code "
                        f"{code}); stopping the stack; see {child.log_path}"
                    )
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (len(child.exits) - 1))
                child.restart_at = now + delay
                self.say(f"{child.name} exited with code {code}; restarting in {delay:.0f} s (see {child.log_path})")
            elif now >= child.restart_at:
                child.process = self._popen(child.args, child.env, child.log_path)
                child.restart_at = None
                child.restarts += 1
                self.say(f"{child.name} restarted (pid {child.process.pid}, restart {child.restarts})")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every running child (newest first), then SIGKILL what is still running after ``grace_s``."""
        # Only the ones running now: an exited child's leftovers went at its exit (``check``), and its old pid may
        # since name another process group.
        running = [child for child in reversed(self.children) if child.process.poll() is None]
        for child in self.children:
            if child.restart_at is None and child not in running:  # exited since the last check: not seen yet
                _kill_leftovers(child.process)
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            _kill_leftovers(child.process)


def _kill_leftovers(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL what an exited child left in its process group (its own session: the group's id is its pid).

    A child SIGKILLed, or crashed, cannot stop its own children: a Celery worker's embedded beat, for one, then
    sleeps on as an orphan, holding its schedule file. A group keeps its id while any member lives, so the id names
    only the leftovers; none left is the usual case."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
