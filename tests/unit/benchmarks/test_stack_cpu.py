"""benchmarks.stack_cpu: what the report charges to each role, and how much of it is not the engine's."""

from __future__ import annotations

import pytest

from benchmarks.stack_cpu import Streams, main, report


def test_the_report_sums_processes_by_role_and_names_what_is_not_the_engine() -> None:
    pids = {10: "engine", 11: "kafka", 12: "batch-worker", 13: "batch-worker"}
    seen = Streams(tokens=100, ttft_s=[0.1, 0.3, 0.2], decode_tok_s=[20.0, 30.0, 25.0])
    text = report(pids, seen, 10.0, {10: 3.0, 11: 0.5, 12: 0.25, 13: 0.25})
    assert "3 streams, 100 tokens in 10.0 s" in text and "p50 25.0; TTFT p50 200 ms" in text
    assert "CPU of the stack 400 ms/s, of which not the engine's 100 ms/s (25 %)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "process" not in line]
    # Largest first; the two batch workers are one row.
    assert rows == ["| engine | 300.0 | 30.00 |", "| kafka | 50.0 | 5.00 |", "| batch-worker | 50.0 | 5.00 |"]


def test_nonsense_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
    assert "--seconds must be positive" in capsys.readouterr().err
