"""What a test needs that this machine may lack: a skip on a developer's machine, a failure in CI.

``bash infra/local/run.sh test`` (and so ``.ci/run``) installs every binary, service and library the suite uses
(redis-sentinel, the Kafka jars, helm, chromium, triton, bitsandbytes...). So where ``CI`` is set (``true``,
``1`` or ``yes``, as CI systems set it) a missing one is a failure that names it, never a quiet skip. Only
hardware the machine lacks (CUDA, a CPU feature) may still skip there: use a plain ``pytest.skip`` /
``skipif`` for that, and these helpers for everything else.

* :func:`require` / :func:`require_tool` inside a test or fixture;
* :func:`needs` as a mark (``pytestmark = needs(ok, "chromium")``), checked when each test sets up;
* :func:`require_import` at module level in place of ``pytest.importorskip``.

This module is a pytest plugin (``tests/conftest.py`` loads it with ``pytest_plugins``): its hooks register and
enforce the ``needs`` mark.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

_TRUTHY = frozenset({"1", "true", "yes", "on"})


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set to a true value: nothing the suite needs may skip."""
    return os.environ.get("CI", "").strip().lower() in _TRUTHY


def _message(what: str, hint: str) -> str:
    return f"{what} is missing" + (f" ({hint})" if hint else "")


def require(available: bool, what: str, hint: str = "", *, module_level: bool = False) -> None:
    """Skip (outside CI) or fail (under ``CI``) the current test when ``available`` is false, naming ``what``."""
    if available:
        return
    message = _message(what, hint)
    if in_ci():
        pytest.fail(f"CI: {message}; infra/local/run.sh test installs it, so it must be here", pytrace=False)
    pytest.skip(message, allow_module_level=module_level)


def require_tool(name: str, hint: str = "") -> str:
    """The path of executable ``name`` on PATH (or an absolute path given); skips or fails when it is missing."""
    found = shutil.which(name)
    if found is None and Path(name).is_absolute() and os.access(name, os.X_OK):
        found = name
    require(found is not None, name, hint or f"not found on PATH: {name}")
    assert found is not None
    return found


def require_import(module: str, hint: str = "") -> ModuleType:
    """Import ``module`` for a test file, like ``pytest.importorskip``, but failing under ``CI``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        error = str(exc)
    require(False, f"Python module {module}", hint or error, module_level=True)
    raise AssertionError("unreachable: require skipped or failed")


def require_triton_interpreter(interpreted: bool) -> None:
    """Triton kernels on CPU tensors need Triton's interpreter, chosen before triton's first import
    (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``): a test that finds it off skips, or fails under ``CI``."""
    require(interpreted, "Triton's interpreter on the CPU", "TRITON_INTERPRET=1 before triton's first import")


def needs(available: bool, what: str, hint: str = "") -> pytest.MarkDecorator:
    """A mark: the test skips (outside CI) or fails (under ``CI``) at set-up when ``available`` is false."""
    return pytest.mark.needs(available=available, what=what, hint=hint)


def pytest_configure(config: pytest.Config) -> None:
    """Registers the ``needs`` mark."""
    config.addinivalue_line(
        "markers", "needs(available, what, hint): a binary, service or library the test needs; fails under CI=true"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Enforces every ``needs`` mark on the test (module, class and function marks alike)."""
    for mark in item.iter_markers("needs"):
        require(bool(mark.kwargs["available"]), str(mark.kwargs["what"]), str(mark.kwargs.get("hint", "")))
