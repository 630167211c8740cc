"""``sluicegate bench --target batch``: the prompts as one OpenAI Batch API job (upload, create, poll to a terminal
status), reporting lines/s and how good the batch's ETA was: Sluicegate's ``eta_seconds``, as the client sees it
the first time a tenth of the lines are done, against the finish the client then sees (|predicted - real| over
the time that was really left, as ``benchmarks/batch.py`` scores it)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from typing import Any

from cli.bench import measure as bench
from cli.bench.measure import Prompt, progress_bar, request_body, unreachable

ETA_CHECK_AT = 0.10
BATCH_TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def run_batch(args: argparse.Namespace, base_url: str, key: str, prompts: list[Prompt]) -> dict[str, Any]:
    """One batch of every prompt: upload, create, poll to a terminal status; lines/s and the ETA's error."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=60)
    url = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    lines = []
    for i, prompt in enumerate(prompts):
        _, body = request_body(args, args.model, prompt, stream=False)
        lines.append(json.dumps({"custom_id": f"bench-{i}", "method": "POST", "url": url, "body": body}))
    batch = None
    try:
        uploaded = client.files.create(file=("bench.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        created = time.monotonic()
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h")
        eta_check: tuple[float, float] | None = None
        bar = None if args.no_progress else progress_bar()
        with bar or nullcontext():
            task = bar.add_task(f"batch {batch.id}", total=len(prompts), failed=0, rate="") if bar else None
            while batch.status not in BATCH_TERMINAL:
                time.sleep(args.poll_interval)
                batch = client.batches.retrieve(batch.id)
                now, counts = time.monotonic(), batch.request_counts
                done = (counts.completed + counts.failed) if counts else 0
                eta = (batch.model_extra or {}).get("eta_seconds")
                if eta_check is None and isinstance(eta, int | float) and done >= ETA_CHECK_AT * len(prompts):
                    eta_check = (now, now + float(eta))
                if bar is not None and task is not None:
                    rate = f"{done / (now - created):,.1f} lines/s"
                    bar.update(task, completed=done, failed=counts.failed if counts else 0, rate=rate)
        finished = time.monotonic()
    except KeyboardInterrupt:
        # Stopping the benchmark stops its load: the batch would otherwise run on, unwatched.
        if batch is not None and batch.status not in BATCH_TERMINAL:
            try:
                client.batches.cancel(batch.id)
                said = f"batch {batch.id} cancelled"
            except openai.OpenAIError as exc:
                said = f"batch {batch.id} was not cancelled ({exc}); cancel it with POST /v1/batches/{batch.id}/cancel"
            print(f"sluicegate bench: interrupted: {said}", file=sys.stderr, flush=True)
        raise
    except openai.APIStatusError as exc:
        raise bench.BenchError(f"batch: {exc.status_code} {exc.message}") from exc
    except openai.APIConnectionError as exc:
        raise unreachable(base_url, exc.__cause__ or exc) from exc
    counts, wall = batch.request_counts, finished - created
    result: dict[str, Any] = {
        "label": f"batch of {len(prompts)}",
        "batch_id": batch.id,
        "status": batch.status,
        "lines": len(prompts),
        "completed": counts.completed if counts else 0,
        "failed": counts.failed if counts else 0,
        "wall_s": wall,
        "lines_per_s": len(prompts) / wall if wall > 0 else 0.0,
        "eta_predicted_s": None,
        "eta_actual_s": None,
        "eta_error_pct": None,
    }
    if eta_check is not None and finished > eta_check[0]:
        seen, predicted = eta_check
        result |= {"eta_predicted_s": predicted - seen, "eta_actual_s": finished - seen}
        result["eta_error_pct"] = 100 * abs(predicted - finished) / (finished - seen)
    return result


def batch_table(batch: dict[str, Any]) -> Any:
    """The batch's figures as a ``rich`` table."""
    from rich.table import Table

    table = Table(title="sluicegate bench (batch)")
    for column in ("batch", "status", "completed/failed of lines", "wall s", "lines/s", "ETA error"):
        table.add_column(column, justify="left" if column in ("batch", "status") else "right")
    eta = "n/a" if batch["eta_error_pct"] is None else f"{batch['eta_error_pct']:.1f} %"
    table.add_row(
        batch["batch_id"],
        batch["status"],
        f"{batch['completed']}/{batch['failed']} of {batch['lines']}",
        f"{batch['wall_s']:,.1f}",
        f"{batch['lines_per_s']:,.2f}",
        eta,
    )
    table.caption = f"ETA error: eta_seconds seen once {ETA_CHECK_AT:.0%} of the lines were done vs the real finish"
    return table
