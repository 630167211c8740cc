"""``sluicegate up``'s supervisor on real child processes: an exited child is restarted after a doubling
backoff with a log line, a crash loop stops with the child's name and log, and stop() ends every child."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from cli.stack.supervisor import Child, CrashLoop, Supervisor

SLEEPER = ["import time; time.sleep(60)"]
CRASHER = ["import sys; sys.exit(3)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _supervisor(tmp_path: Path, clock: Clock, lines: list[str]) -> Supervisor:
    return Supervisor(tmp_path, command=(sys.executable, "-c"), clock=clock, say=lines.append, max_crashes=3)


def _wait_exit(child: Child) -> None:
    if child.restart_at is None:
        child.process.wait(timeout=30)


def test_a_killed_child_is_restarted_after_its_backoff(tmp_path: Path) -> None:
    clock, lines = Clock(), []
    supervisor = _supervisor(tmp_path, clock, lines)
    child = supervisor.start("worker", SLEEPER, {})
    try:
        first = child.process.pid
        supervisor.check()
        assert child.running and not lines
        child.process.kill()
        child.process.wait(timeout=30)
        supervisor.check()
        assert lines == [f"worker exited with code -9; restarting in 1 s (see {tmp_path / 'worker.log'})"]
        assert not child.running
        clock.now += 0.5
        supervisor.check()  # not due yet
        assert child.restart_at is not None
        clock.now += 0.6
        supervisor.check()
        assert child.running and child.process.pid != first and child.restarts == 1
        assert lines[-1] == f"worker restarted (pid {child.process.pid}, restart 1)"
    finally:
        supervisor.stop(grace_s=5)
    assert child.process.poll() is not None


def test_the_backoff_doubles_and_a_crash_loop_stops_naming_the_child(tmp_path: Path) -> None:
    clock, lines = Clock(), []
    supervisor = _supervisor(tmp_path, clock, lines)
    crashed = supervisor.start("batch-worker", CRASHER, {})
    supervisor.start("ingress", SLEEPER, {})
    try:
        delays = []
        with pytest.raises(CrashLoop) as raised:
            for _ in range(10):
                _wait_exit(crashed)
                supervisor.check()
                if crashed.restart_at is not None:
                    delays.append(crashed.restart_at - clock.now)
                    clock.now = crashed.restart_at
                    supervisor.check()
        assert delays == [1.0, 2.0]
        message = str(raised.value)
        assert message.startswith("batch-worker exited 3 times within 60 s (last exit code 3)")
        assert str(tmp_path / "batch-worker.log") in message
        assert supervisor.children[1].running  # the others are left to the caller's stop()
    finally:
        supervisor.stop(grace_s=5)


def test_exits_outside_the_window_do_not_add_up(tmp_path: Path) -> None:
    clock, lines = Clock(), []
    supervisor = _supervisor(tmp_path, clock, lines)
    child = supervisor.start("router", CRASHER, {})
    try:
        for _ in range(6):  # twice the crash limit, but each exit a window apart
            _wait_exit(child)
            supervisor.check()
            assert child.restart_at == clock.now + 1.0  # the backoff starts over too
            clock.now += 61
            supervisor.check()
        assert child.restarts == 6
    finally:
        supervisor.stop(grace_s=5)


def test_stop_ends_children_that_ignore_sigterm(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, command=(sys.executable, "-c"), say=lambda _: None)
    ready = tmp_path / "ignoring"
    code = (
        "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    stubborn = supervisor.start("stubborn", [code], {})
    deadline = time.monotonic() + 60
    while not ready.exists():  # its handler is installed (a busy machine's interpreter start-up can take seconds)
        assert time.monotonic() < deadline and stubborn.process.poll() is None
        time.sleep(0.02)
    started = time.monotonic()
    supervisor.stop(grace_s=1)
    assert stubborn.process.returncode == -9 and time.monotonic() - started < 10


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("ending", ["stopped", "crashed"])
def test_what_a_child_leaves_behind_goes_with_it(tmp_path: Path, ending: str) -> None:
    """A child SIGKILLed at stop (or one that crashed) cannot stop its own children: a Celery worker's embedded
    beat once slept on after `up` had stopped. Its process group goes with it."""
    supervisor = Supervisor(tmp_path, command=(sys.executable, "-c"), say=lambda _: None)
    pid_file = tmp_path / "grandchild"
    code = (
        "import pathlib, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); "
        + ("sys.exit(3)" if ending == "crashed" else "time.sleep(60)")
    )
    child = supervisor.start("parent", [code], {})
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    grandchild = int(pid_file.read_text())
    try:
        if ending == "crashed":
            _wait_exit(child)
            supervisor.check()  # notes the exit (and schedules a restart, not due yet)
        else:
            supervisor.stop(grace_s=1)
            assert child.process.returncode == -9
        deadline = time.monotonic() + 10
        while _alive(grandchild):
            assert time.monotonic() < deadline, "the child's own child outlived it"
            time.sleep(0.05)
    finally:
        supervisor.stop(grace_s=1)
