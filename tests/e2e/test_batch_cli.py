"""``sluicegate batch`` against the running stack, as a batch user runs it: ``submit --wait`` to completion,
``status``, ``list``, ``download``, ``cancel``, and the server's own message (exit 2) for bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .batch_support import TERMINAL, chat_line, parse_jsonl, wait_until, write_jsonl
from .conftest import Pipeline, Service

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def cli(pipeline: Pipeline, *args: str, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``sluicegate batch ARGS`` as a user would, with the key from ``OPENAI_API_KEY``."""
    env = {k: v for k, v in pipeline.env.items() if k not in ("SLUICEGATE_API_KEY", "OPENAI_API_KEY")}
    env["OPENAI_API_KEY"] = pipeline.api_key
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "batch", *args, "--base-url", f"{pipeline.ingress_url}/v1"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_submit_wait_then_download(pipeline: Pipeline, batch_worker: Service, tmp_path: Path) -> None:
    lines = [chat_line(f"cli-{i}", pipeline.model, max_tokens=4) for i in range(20)]
    lines.append(chat_line("cli-bad", pipeline.model, temperature=9))  # refused body: an error line
    path = write_jsonl(tmp_path / "in.jsonl", lines)

    done = cli(pipeline, "submit", str(path), "--wait", "--interval", "0.3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    first = re.match(r"batch (batch_\S+): completed ", done.stdout)
    assert first, done.stdout
    batch_id = first.group(1)
    assert "lines: 20 completed, 1 failed, 21 total" in done.stdout
    assert "  output: " in done.stdout
    assert f"sluicegate batch download {batch_id}" in done.stdout
    assert "completed" in done.stderr and "lines/s" in done.stderr  # the progress bar went to stderr

    status = cli(pipeline, "status", batch_id, "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert '"status": "completed"' in status.stdout

    listing = cli(pipeline, "list", "--limit", "5", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert batch_id in listing.stdout

    got = cli(pipeline, "download", batch_id, "--output", "out.jsonl", "--errors", "err.jsonl", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    outputs = parse_jsonl((tmp_path / "out.jsonl").read_text())
    errors = parse_jsonl((tmp_path / "err.jsonl").read_text())
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"cli-{i}" for i in range(20))
    assert [e["custom_id"] for e in errors] == ["cli-bad"]
    assert all(o["response"]["status_code"] == 200 for o in outputs)


def test_cancel_keeps_what_finished(pipeline: Pipeline, batch_worker: Service, tmp_path: Path) -> None:
    lines = [chat_line(f"c-{i}", pipeline.model, max_tokens=64, ignore_eos=True) for i in range(300)]
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    submitted = cli(pipeline, "submit", str(path), cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()

    cancelled = cli(pipeline, "cancel", batch_id, cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() in (f"batch {batch_id}: cancelling", f"batch {batch_id}: cancelled")

    batch = wait_until(pipeline.openai(), batch_id, lambda b: b.status in TERMINAL, timeout_s=120)
    assert batch.status == "cancelled", batch.model_dump_json()
    status = cli(pipeline, "status", batch_id, cwd=tmp_path)
    assert status.returncode == 0 and f"batch {batch_id}: cancelled" in status.stdout


def test_unknown_batch_is_the_servers_404(pipeline: Pipeline, tmp_path: Path) -> None:
    for args in (("status", "batch_nope"), ("cancel", "batch_nope"), ("download", "batch_nope")):
        result = cli(pipeline, *args, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("sluicegate batch: error: ")
        assert ": 404 " in result.stderr and "batch_nope" in result.stderr, result.stderr


def test_non_jsonl_is_refused_with_the_servers_message(pipeline: Pipeline, tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text("this is not json\n")
    result = cli(pipeline, "submit", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert ": 400 " in result.stderr, result.stderr
    assert "line 1" in result.stderr, result.stderr
