"""Building batch input files and auditing a finished batch's output and error files (OpenAI's line format),
shared by the batch end-to-end tests."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TERMINAL = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, model: str, *, max_tokens: int = 8, **body: Any) -> dict[str, Any]:
    """One ``/v1/chat/completions`` line of a batch input file."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell me about {custom_id}"}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass
class Audit:
    """What a batch's output and error files hold, by ``custom_id``."""

    outputs: list[dict[str, Any]]
    errors: list[dict[str, Any]]

    @property
    def counts(self) -> collections.Counter[str]:
        return collections.Counter(line["custom_id"] for line in self.outputs + self.errors)

    def check_exactly_once(self, expected: set[str]) -> None:
        """Every expected ``custom_id`` in exactly one line of output + errors, and nothing else."""
        counts = self.counts
        duplicated = sorted(k for k, n in counts.items() if n > 1)
        missing = sorted(expected - counts.keys())
        unexpected = sorted(counts.keys() - expected)
        assert not (duplicated or missing or unexpected), (
            f"duplicated {duplicated[:10]} ({len(duplicated)}), missing {missing[:10]} ({len(missing)}), "
            f"unexpected {unexpected[:10]} ({len(unexpected)})"
        )


def audit(client: Any, batch: Any) -> Audit:
    """Download the batch's output and error files through the SDK."""
    outputs = parse_jsonl(client.files.content(batch.output_file_id).text) if batch.output_file_id else []
    errors = parse_jsonl(client.files.content(batch.error_file_id).text) if batch.error_file_id else []
    return Audit(outputs, errors)


def wait_until(client: Any, batch_id: str, done: Any, timeout_s: float, interval_s: float = 0.2) -> Any:
    """Poll ``batches.retrieve`` until ``done(batch)``; the last batch seen is in the failure message."""
    deadline = time.monotonic() + timeout_s
    batch = client.batches.retrieve(batch_id)
    while not done(batch):
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} not there within {timeout_s}s: {batch.model_dump_json()}")
        time.sleep(interval_s)
        batch = client.batches.retrieve(batch_id)
    return batch


def finished(batch: Any) -> int:
    counts = batch.request_counts
    return 0 if counts is None else counts.completed + counts.failed
