"""``sluicegate batch``: the command line for batch users, itself an OpenAI client.

``submit`` uploads a JSONL file (``purpose=batch``) and creates the batch, and with ``--wait`` shows a ``rich``
progress bar (completed / failed / total, rate, ETA) until the batch reaches a terminal status; ``status``,
``list``, ``cancel`` and ``download`` do what they say. Every call goes through the official ``openai`` SDK to
ingress's Files and Batches API, so what works here works from any OpenAI client; ingress is the one home of
validation and its error message (OpenAI's error shape) is what the user sees.

Exit codes: 0 done; 1 the batch ended other than ``completed`` (``submit --wait``); 2 bad input or
an error the server returned (missing file, unknown id: the server's own 404 message); 3 ingress unreachable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sluicegate.settings import get_settings

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types import Batch

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
EXIT_NOT_COMPLETED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3


class BatchCliError(Exception):
    """An error reported as one line on stderr; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


# --- the client ------------------------------------------------------------------------------------------------


def base_url(args: argparse.Namespace) -> str:
    """``--base-url``, else ``SLUICEGATE_API_BASE_URL``, else the local ingress (``SLUICEGATE_INGRESS_PORT``)."""
    settings = get_settings()
    return args.base_url or settings.api_base_url or f"http://127.0.0.1:{settings.ingress_port}/v1"


def api_key(args: argparse.Namespace) -> str:
    """``--api-key``, else ``OPENAI_API_KEY``, else ``SLUICEGATE_API_KEY``."""
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or get_settings().api_key
    if not key:
        raise BatchCliError("no API key: pass --api-key or set OPENAI_API_KEY or SLUICEGATE_API_KEY")
    return key


def make_client(args: argparse.Namespace) -> OpenAI:
    from openai import OpenAI

    # A line per HTTP call is noise on a user's terminal (the services' log level may be INFO); errors still show.
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))

    # The SDK's own retries (with backoff) cover a restarting ingress; a batch user never sees a lone blip.
    return OpenAI(base_url=base_url(args), api_key=api_key(args), max_retries=args.retries, timeout=args.timeout)


def _call(what: str, fn: Callable[[], Any]) -> Any:
    """Run one SDK call, turning its errors into one clear line: the server's message for a 4xx/5xx."""
    import openai

    try:
        return fn()
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        message = body.get("message") or exc.message
        param = f" (param: {body['param']})" if body.get("param") else ""
        raise BatchCliError(f"{what}: {exc.status_code} {message}{param}") from exc
    except openai.APIConnectionError as exc:
        where = exc.request.url if getattr(exc, "request", None) is not None else "ingress"
        raise BatchCliError(f"{what}: cannot reach {where} ({exc.__cause__ or exc})", EXIT_UNREACHABLE) from exc


# --- submit ----------------------------------------------------------------------------------------------------


def endpoint_of(path: Path) -> str | None:
    """The ``url`` of the file's first line (every line of a batch names the same endpoint), if it has one."""
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    line = json.loads(raw)
                except ValueError:
                    return None  # the server names the bad line; guessing here would only hide it
                url = line.get("url") if isinstance(line, dict) else None
                return url if isinstance(url, str) else None
    return None


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BatchCliError(f"--metadata takes KEY=VALUE, got {pair!r}")
        metadata[key] = value
    return metadata


def _submit(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise BatchCliError(f"{path}: no such file")
    if not os.access(path, os.R_OK):
        raise BatchCliError(f"{path}: not readable")
    endpoint = args.endpoint or endpoint_of(path) or ENDPOINTS[0]
    metadata = parse_metadata(args.metadata)
    client = make_client(args)
    with path.open("rb") as handle:
        uploaded = _call(f"upload {path}", lambda: client.files.create(file=(path.name, handle), purpose="batch"))
    create: dict[str, Any] = {"input_file_id": uploaded.id, "endpoint": endpoint, "completion_window": "24h"}
    if metadata:
        create["metadata"] = metadata
    batch = _call("create batch", lambda: client.batches.create(**create))
    _err(f"uploaded {path} as {uploaded.id}; batch {batch.id} created ({endpoint})")
    if not args.wait:
        print(batch.id)
        return 0
    batch = wait(client, batch, interval_s=args.interval)
    print(describe(batch, base_url(args)))
    return 0 if batch.status == "completed" else EXIT_NOT_COMPLETED


def wait(client: OpenAI, batch: Batch, *, interval_s: float) -> Batch:
    """Poll until ``batch`` is terminal, drawing a progress bar (on stderr) of finished lines."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Finished lines per second, over rich's recent-speed window (so the ETA follows the current pace)."""

        def render(self, task: Task) -> Text:
            if task.speed is None:
                return Text("-- lines/s", style="cyan")
            return Text(f"{task.speed:,.{0 if task.speed >= 10 else 1}f} lines/s", style="cyan")

    class EtaColumn(ProgressColumn):
        """The server's ETA (``eta_seconds``, from the model's backlog and completion rate) when it gives one,
        else rich's estimate from the rate seen here."""

        fallback = TimeRemainingColumn()

        def render(self, task: Task) -> Text:
            eta = task.fields.get("eta")
            if eta is None:
                return self.fallback.render(task)
            minutes, seconds = divmod(int(eta), 60)
            hours, minutes = divmod(minutes, 60)
            return Text(f"{hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=12),
        TextColumn("[green]{task.fields[ok]}[/] completed, [red]{task.fields[failed]}[/] failed of {task.fields[n]}"),
        RateColumn(),
        TextColumn("ETA"),
        EtaColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(batch.status, total=None, ok=0, failed=0, n="?", eta=None)
        while True:
            counts = batch.request_counts
            eta = (batch.model_extra or {}).get("eta_seconds")  # Sluicegate's extra field; the SDK keeps it
            bar.update(task, eta=eta if isinstance(eta, int | float) and batch.status == "in_progress" else None)
            if counts is not None and counts.total:
                bar.update(
                    task,
                    description=batch.status,
                    total=counts.total,
                    completed=counts.completed + counts.failed,
                    ok=counts.completed,
                    failed=counts.failed,
                    n=counts.total,
                )
            else:
                bar.update(task, description=batch.status)
            if batch.status in TERMINAL:
                return batch
            time.sleep(interval_s)
            batch = _call(f"poll {batch.id}", lambda b=batch: client.batches.retrieve(b.id))


# --- status, list, cancel, download --------------------------------------------------------------------------------


def describe(batch: Batch, url: str) -> str:
    """A few lines a person reads: status, counts, timestamps, and where the output and errors are."""
    counts = batch.request_counts
    lines = [f"batch {batch.id}: {batch.status}  ({batch.endpoint}, input {batch.input_file_id})"]
    if counts is not None:
        lines.append(f"  lines: {counts.completed} completed, {counts.failed} failed, {counts.total} total")
    eta = (batch.model_extra or {}).get("eta_seconds")
    if isinstance(eta, int | float) and batch.status not in TERMINAL:
        lines.append(f"  eta: about {eta:,.0f} s (the server's estimate from the backlog)")
    stamps = [(name.removesuffix("_at"), getattr(batch, name)) for name in _STAMPS if getattr(batch, name)]
    if stamps:
        lines.append("  " + ", ".join(f"{name} {_when(value)}" for name, value in stamps))
    for error in (batch.errors.data or []) if batch.errors else []:
        where = f" (line {error.line})" if error.line is not None else ""
        lines.append(f"  error{where}: {error.code}: {error.message}")
    base = url.rstrip("/")
    if batch.output_file_id:
        lines.append(f"  output: {batch.output_file_id}  ({base}/files/{batch.output_file_id}/content)")
    if batch.error_file_id:
        lines.append(f"  errors: {batch.error_file_id}  ({base}/files/{batch.error_file_id}/content)")
    if batch.output_file_id or batch.error_file_id:
        lines.append(f"  download: sluicegate batch download {batch.id}")
    return "\n".join(lines)


_STAMPS = (
    "created_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "expires_at",
)


def _when(epoch_s: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_s))


def _status(args: argparse.Namespace) -> int:
    client = make_client(args)
    batch = _call(f"batch {args.batch_id}", lambda: client.batches.retrieve(args.batch_id))
    print(batch.model_dump_json(indent=2) if args.json else describe(batch, base_url(args)))
    return 0


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    client = make_client(args)
    query: dict[str, Any] = {"limit": args.limit}
    if args.after:
        query["after"] = args.after
    page = _call("list batches", lambda: client.batches.list(**query))
    batches = list(page.data)  # one page: --limit is what the user asked to see
    if args.json:
        print(json.dumps([b.model_dump(mode="json") for b in batches], indent=2))
        return 0
    if not batches:
        print("no batches")
        return 0
    table = Table("id", "status", "endpoint", "created", "completed", "failed", "total", "output")
    for batch in batches:
        counts = batch.request_counts
        done, failed, total = (counts.completed, counts.failed, counts.total) if counts else (0, 0, 0)
        table.add_row(
            batch.id,
            batch.status,
            batch.endpoint,
            _when(batch.created_at),
            str(done),
            str(failed),
            str(total),
            batch.output_file_id or "",
        )
    Console(width=max(160, Console().width)).print(table)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    client = make_client(args)
    batch = _call(f"cancel {args.batch_id}", lambda: client.batches.cancel(args.batch_id))
    print(f"batch {batch.id}: {batch.status}")
    return 0


def _download(args: argparse.Namespace) -> int:
    client = make_client(args)
    batch = _call(f"batch {args.batch_id}", lambda: client.batches.retrieve(args.batch_id))
    if not batch.output_file_id and not batch.error_file_id:
        raise BatchCliError(f"batch {batch.id} is {batch.status}: it has no output or error file yet")
    wrote = []
    for file_id, target, kind in (
        (batch.output_file_id, args.output or f"{batch.id}_output.jsonl", "output"),
        (batch.error_file_id, args.errors or f"{batch.id}_errors.jsonl", "errors"),
    ):
        if not file_id:
            continue
        content = _call(f"download {kind} {file_id}", lambda f=file_id: client.files.content(f))
        if target == "-":
            sys.stdout.buffer.write(content.content)
            sys.stdout.flush()
        else:
            Path(target).write_bytes(content.content)
            lines = content.content.count(b"\n")
            wrote.append(f"{kind}: {target} ({lines} lines)")
    for line in wrote:
        _err(line)
    return 0


# --- the parser ------------------------------------------------------------------------------------------------


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a handler so a ``BatchCliError`` prints one line and exits with its own code."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BatchCliError as exc:
            _fail(str(exc), exc.code)

    return run


def _fail(message: str, code: int) -> NoReturn:
    print(f"sluicegate batch: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def add_batch_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``sluicegate batch submit|status|list|cancel|download`` on the top-level subparsers."""
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--base-url", help="OpenAI base URL of ingress (default: SLUICEGATE_API_BASE_URL or local)")
    client.add_argument("--api-key", help="API key (default: OPENAI_API_KEY, then SLUICEGATE_API_KEY)")
    client.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP call (default 60)")
    client.add_argument("--retries", type=int, default=2, help="SDK retries per call (default 2)")

    batch = sub.add_parser("batch", help="OpenAI batch jobs: submit, status, list, cancel, download")
    actions = batch.add_subparsers(dest="action", required=True)

    submit = actions.add_parser("submit", parents=[client], help="upload a JSONL file and create a batch")
    submit.add_argument("file", help="JSONL: one {custom_id, method, url, body} per line")
    submit.add_argument("--endpoint", choices=ENDPOINTS, help="default: the first line's url")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    submit.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    submit.add_argument("--interval", type=float, default=1.0, help="seconds between polls with --wait")
    submit.set_defaults(handler=_run(_submit))

    status = actions.add_parser("status", parents=[client], help="one batch: status, counts, output files")
    status.add_argument("batch_id")
    status.add_argument("--json", action="store_true", help="the Batch object as JSON")
    status.set_defaults(handler=_run(_status))

    listing = actions.add_parser("list", parents=[client], help="recent batches, newest first")
    listing.add_argument("--limit", type=int, default=20, help="how many (1-100, default 20)")
    listing.add_argument("--after", help="a batch id: list those after it (pagination)")
    listing.add_argument("--json", action="store_true", help="the Batch objects as JSON")
    listing.set_defaults(handler=_run(_list))

    cancel = actions.add_parser("cancel", parents=[client], help="cancel a batch (finished lines are kept)")
    cancel.add_argument("batch_id")
    cancel.set_defaults(handler=_run(_cancel))

    download = actions.add_parser("download", parents=[client], help="write a batch's output and error files")
    download.add_argument("batch_id")
    download.add_argument("--output", help="output file (default <id>_output.jsonl; - for stdout)")
    download.add_argument("--errors", help="error file (default <id>_errors.jsonl; - for stdout)")
    download.set_defaults(handler=_run(_download))
