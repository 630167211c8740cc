"""The e2e harness's failure report: a failing test's report ends with the tail of each running service's log
(CI keeps only pytest's output), and a passing one carries nothing extra. No services run: the hook is driven with
a pipeline handle over log files written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import conftest
from .conftest import REPORT_LOG_LINES, Pipeline


def report_of(outcome: str, when: str = "call") -> pytest.TestReport:
    """What pytest's hooks return for a test with ``outcome``, after the harness's hook saw it."""
    hook = conftest.pytest_runtest_makereport(item=None, call=None)  # type: ignore[arg-type]
    next(hook)
    report = pytest.TestReport("t.py::t", ("t.py", 0, "t"), {}, outcome, None, when)  # type: ignore[arg-type]
    try:
        hook.send(report)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise AssertionError("the hook wrapper yielded twice")


def test_a_failing_test_reports_the_tail_of_every_running_service_log(tmp_path: Path) -> None:
    (tmp_path / "worker-a.log").write_text("".join(f"line {n}\n" for n in range(REPORT_LOG_LINES + 25)))
    (tmp_path / "router.log").write_text("router.started\n")
    pipe = Pipeline(
        env={},
        log_dir=tmp_path,
        ingress_url="",
        result_url="",
        prefix="",
        redis_url="",
        kafka_bootstrap="",
        model="",
    )
    conftest._RUNNING.append(pipe)
    try:
        failed, setup_failed, passed = report_of("failed"), report_of("failed", "setup"), report_of("passed")
    finally:
        conftest._RUNNING.remove(pipe)
    assert dict(failed.sections) == {
        "service log router.log (last 1 lines)": "router.started",
        f"service log worker-a.log (last {REPORT_LOG_LINES} lines)": "\n".join(
            f"line {n}" for n in range(25, REPORT_LOG_LINES + 25)
        ),
    }
    assert setup_failed.sections == failed.sections
    assert passed.sections == []
    assert report_of("failed").sections == [], "a pipeline no longer running is not reported"
