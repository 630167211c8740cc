"""A pytest plugin: a test marked ``alone`` runs while no other test runs, even under pytest-xdist.

Some end-to-end tests compare a latency under load with the same latency idle, measured a minute earlier in the
same test. Under ``pytest -n 2`` the other worker meanwhile starts and drives whole pipelines on the other core,
so a burst there lands on one phase and not the other, and the comparison measures the neighbour. Such a test
takes this plugin's lock exclusively; every other test holds it shared, so the neighbour finishes its current
test, then waits. Outside xdist nothing is locked.

The lock is a readers-writer pair of ``flock`` files in the temporary folder, named by xdist's run id (every
worker of a run sees the same). A turnstile in front keeps a waiting ``alone`` test from being starved by a
stream of shared holders: each shared taker passes through it, and the exclusive taker holds it while it waits.
The lock wraps the whole test protocol (setup, call, teardown) outside pytest-timeout's timer, so waiting for
the neighbour's test never counts against a test's own timeout.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

MARKER = "alone"


_FOLDER = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: runs while no other test runs (under pytest-xdist the other workers wait)"
    )
    # Only xdist's workers lock: a plain run has no neighbour, and the controller runs no tests.
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is not None and hasattr(config, "workerinput"):
        folder = Path(tempfile.gettempdir()) / f"sluicegate-pytest-{run_id}"
        folder.mkdir(exist_ok=True)
        config.stash[_FOLDER] = folder


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    # One open file per hold: flock locks belong to the open file description, not to the process.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def held(folder: Path, exclusive: bool) -> Iterator[None]:
    """The run's lock: exclusive for an ``alone`` test, shared for every other."""
    with contextlib.ExitStack() as holding:
        with _flock(folder / "turnstile", fcntl.LOCK_EX):
            holding.enter_context(_flock(folder / "lock", fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH))
        yield


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    folder = item.config.stash.get(_FOLDER, None)
    if folder is None:
        return (yield)
    with held(folder, exclusive=item.get_closest_marker(MARKER) is not None):
        return (yield)
