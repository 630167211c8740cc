"""The batch CLI's input checks and error exits that need no server (the flows against a running stack are in
tests/e2e/test_batch_cli.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.main import main
from cli.tools import batch as batch_cli


def _exit_code(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return int(exited.value.code), capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("SLUICEGATE_API_KEY", raising=False)
    batch_cli.get_settings.cache_clear()
    yield
    batch_cli.get_settings.cache_clear()  # no test after this one sees settings read here


def test_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _exit_code(["batch", "submit", str(tmp_path / "nope.jsonl"), "--api-key", "k"], capsys)
    assert code == 2
    assert "nope.jsonl: no such file" in err


def test_no_api_key_says_where_to_put_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("{}\n")
    code, err = _exit_code(["batch", "submit", str(path)], capsys)
    assert code == 2
    assert "OPENAI_API_KEY" in err and "SLUICEGATE_API_KEY" in err


def test_unreachable_ingress_exits_3_and_names_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.common import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    argv = ["batch", "status", "batch_x", "--api-key", "k", "--base-url", url, "--retries", "0"]
    code, err = _exit_code(argv, capsys)
    assert code == 3
    assert f"{url}/batches/batch_x" in err


def test_endpoint_comes_from_the_first_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
    path.write_text("\n" + json.dumps(line) + "\n")
    assert batch_cli.endpoint_of(path) == "/v1/completions"
    path.write_text("not json\n")
    assert batch_cli.endpoint_of(path) is None


def test_metadata_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    assert batch_cli.parse_metadata(["team=search", "note=a=b"]) == {"team": "search", "note": "a=b"}
    with pytest.raises(batch_cli.BatchCliError, match="KEY=VALUE"):
        batch_cli.parse_metadata(["novalue"])


def test_api_key_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    monkeypatch.setenv("SLUICEGATE_API_KEY", "from-sluicegate")
    batch_cli.get_settings.cache_clear()
    assert batch_cli.api_key(argparse.Namespace(api_key=None)) == "from-sluicegate"
    monkeypatch.setenv("OPENAI_API_KEY", "from-openai")
    assert batch_cli.api_key(argparse.Namespace(api_key=None)) == "from-openai"
    assert batch_cli.api_key(argparse.Namespace(api_key="flag")) == "flag"


def test_describe_says_where_the_output_is() -> None:
    from openai.types import Batch

    batch = Batch.model_validate(
        {
            "id": "batch_1",
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "input_file_id": "file-in",
            "completion_window": "24h",
            "status": "completed",
            "created_at": 1_700_000_000,
            "completed_at": 1_700_000_060,
            "output_file_id": "file-out",
            "error_file_id": "file-err",
            "request_counts": {"total": 3, "completed": 2, "failed": 1},
            "errors": {"object": "list", "data": [{"code": "invalid_json", "message": "bad", "line": 4}]},
        }
    )
    text = batch_cli.describe(batch, "http://h:1/v1/")
    assert text.splitlines()[0] == "batch batch_1: completed  (/v1/chat/completions, input file-in)"
    assert "lines: 2 completed, 1 failed, 3 total" in text
    assert "output: file-out  (http://h:1/v1/files/file-out/content)" in text
    assert "errors: file-err  (http://h:1/v1/files/file-err/content)" in text
    assert "error (line 4): invalid_json: bad" in text
    assert "sluicegate batch download batch_1" in text
