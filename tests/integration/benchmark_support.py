"""Runs a benchmark module the way a person does (``python -m benchmarks.<name>``) for the benchmarks' smoke tests:
from the repository root, with none of this shell's ``SLUICEGATE_*`` settings leaking into it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<module> <argv>``, its output captured as text."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *argv],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
