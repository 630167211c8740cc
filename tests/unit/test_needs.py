"""tests/needs.py: a missing tool, library or service skips a test on a developer's machine and fails it under CI.

Each case runs a small test file in a fresh pytest process (with ``needs`` as its plugin, as tests/conftest.py
loads it), once without ``CI`` and once with ``CI=true``, and reads the outcome from pytest's summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]

CASES = {
    "tool": """
from needs import require_tool

def test_it():
    require_tool("sluicegate-no-such-tool-xyz", "apt-get install it")
""",
    "mark": """
from needs import needs

pytestmark = needs(False, "redis-sentinel", "apt-get install redis-sentinel")

def test_it():
    pass
""",
    "module": """
from needs import require_import

require_import("sluicegate_no_such_module_xyz")

def test_it():
    pass
""",
}


def run_pytest(tmp_path: Path, source: str, ci: str | None) -> subprocess.CompletedProcess[str]:
    """Runs ``source`` as a test file in a fresh pytest process with ``CI`` set to ``ci`` (unset for None)."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("needs",)\n')
    (tmp_path / "test_case.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_missing_skips_outside_ci(tmp_path: Path, case: str) -> None:
    run = run_pytest(tmp_path, CASES[case], ci=None)
    assert run.returncode in (0, 5), run.stdout + run.stderr  # 5: a skipped module leaves nothing collected
    assert "1 skipped" in run.stdout and "is missing" in run.stdout, run.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_missing_fails_under_ci_naming_it(tmp_path: Path, case: str) -> None:
    run = run_pytest(tmp_path, CASES[case], ci="true")
    assert run.returncode in (1, 2), run.stdout + run.stderr  # 2: the module failed at collection
    assert "skipped" not in run.stdout, run.stdout
    named = {
        "tool": "sluicegate-no-such-tool-xyz",
        "mark": "redis-sentinel",
        "module": "Python module sluicegate_no_such_module_xyz",
    }
    assert f"CI: {named[case]}" in run.stdout, run.stdout


def test_present_runs_under_ci(tmp_path: Path) -> None:
    source = "from needs import needs, require_tool\n\n@needs(True, 'x')\ndef test_it():\n    require_tool('sh')\n"
    run = run_pytest(tmp_path, source, ci="true")
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout


def test_the_suite_skips_what_it_needs_only_through_needs() -> None:
    """A raw ``pytest.importorskip``, or a bare ``pytest.skip`` over a missing library or interpreter mode, would let
    CI pass while the test never ran; only missing hardware (CUDA, a CPU feature) may skip plainly."""
    raw = ("pytest.importorskip(", "is not installed", "TRITON_INTERPRET=1 before")
    offenders = [
        f"{path.relative_to(TESTS_DIR)}:{number}"
        for path in sorted(TESTS_DIR.rglob("*.py"))
        if path.name not in ("needs.py", Path(__file__).name)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "pytest.skip(" in line or "importorskip(" in line
        if any(marker in line for marker in raw)
    ]
    assert offenders == []
