"""``python -m cli`` is the ``sluicegate`` command line (for machines without the venv's scripts on PATH)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_cli_runs_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "usage: sluicegate" in done.stdout
    assert "bench" in done.stdout and "dlq" in done.stdout


def test_python_m_cli_passes_the_exit_status() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli", "no-such-command"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_a_mistyped_flag_is_one_line_pointing_at_the_subcommand_s_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "--bogus"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "sluicegate bench: error: unrecognized arguments: --bogus (see sluicegate bench --help)"
    ]
