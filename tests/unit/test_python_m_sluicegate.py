"""``python -m sluicegate`` is the ``sluicegate`` command line (for machines without pip's scripts on PATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_sluicegate_runs_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sluicegate", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "usage: sluicegate" in done.stdout
    assert "bench" in done.stdout and "dlq" in done.stdout


def test_python_m_sluicegate_passes_the_exit_status() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sluicegate", "no-such-command"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
