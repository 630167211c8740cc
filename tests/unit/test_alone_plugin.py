"""tests/alone.py: under pytest-xdist, a test marked ``alone`` never runs beside another test.

A small suite runs in a subprocess on two xdist workers: one file holds an ``alone`` test, the other a row of
tests; each test writes down when it ran. With the plugin the intervals never overlap; without it (the control)
they do, so this test fails if the lock stops working.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[1] / "alone.py"

RECORDING = """
import time
from pathlib import Path

import pytest


def ran(name, seconds):
    started = time.time()
    time.sleep(seconds)
    with open(Path(__file__).parent / "ran.txt", "a") as out:
        out.write(f"{name} {started} {time.time()}\\n")
"""

ALONE_FILE = (
    RECORDING
    + """

@pytest.mark.alone
def test_measures():
    ran("alone", 1.0)
"""
)

ROW_FILE = (
    RECORDING
    + """

@pytest.mark.parametrize("n", range(6))
def test_row(n):
    ran(f"row{n}", 0.3)
"""
)


def _run(folder: Path, *plugin: str) -> list[tuple[str, float, float]]:
    (folder / "ran.txt").unlink(missing_ok=True)
    # Only xdist of the installed plugins: each of the three processes would import every one (seconds each).
    env = {**os.environ, "PYTHONPATH": str(folder), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "xdist.plugin", "-n", "2", "--dist", "loadfile"]
    command += ["-p", "no:cacheprovider", *plugin, "-W", "ignore::pytest.PytestUnknownMarkWarning", str(folder)]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in (folder / "ran.txt").read_text().splitlines()]
    return [(name, float(start), float(end)) for name, start, end in rows]


def _overlapping(ran: list[tuple[str, float, float]]) -> list[str]:
    (_, start, end) = next(r for r in ran if r[0] == "alone")
    return [name for name, s, e in ran if name != "alone" and s < end and start < e]


@pytest.mark.slow
def test_an_alone_test_runs_beside_no_other(tmp_path: Path) -> None:
    shutil.copy(PLUGIN, tmp_path / "alone.py")
    (tmp_path / "test_alone_one.py").write_text(ALONE_FILE)
    (tmp_path / "test_row.py").write_text(ROW_FILE)

    locked = _run(tmp_path, "-p", "alone")
    assert len(locked) == 7
    assert _overlapping(locked) == [], locked

    control = _run(tmp_path)  # the same suite without the plugin: the two workers run side by side
    assert _overlapping(control), control
