"""``sluicegate usage``: the caller's tenant's token usage from ingress's ``GET /v1/usage`` (the rollup of the
usage ledger), as a table or JSON. A client of ingress like ``sluicegate batch``: the same base URL, API key,
timeouts and exit codes (2 bad input or an error the server returned, 3 ingress unreachable).

``--start`` and ``--end`` take unix seconds, a date (``2025-01-31``, UTC midnight) or an ISO 8601 time; without
them the report covers the current UTC month so far. Usage is kept by the hour, so the window is widened to
whole hours.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any, NoReturn

from cli.tools.batch import EXIT_BAD_INPUT, BatchCliError, _call, make_client

_COLUMNS = (
    ("requests", "requests"),
    ("prompt_tokens", "prompt"),
    ("cached_tokens", "cached"),
    ("output_tokens", "output"),
    ("total_tokens", "total"),
    ("finished", "finished"),
    ("cancelled", "cancelled"),
    ("failed", "failed"),
    ("response_cache", "cache hits"),
)


def parse_time(value: str) -> int:
    """Unix seconds from unix seconds, a date or an ISO 8601 time (naive means UTC)."""
    text = value.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not unix seconds, a date or an ISO 8601 time: {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp())


def _stamp(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M UTC")


def render(report: dict[str, Any]) -> str:
    """The report as a text table: a row per group (if grouped), then the tenant's total."""
    group = report.get("group_by")
    label = {"model": "model", "key": "key id", "adapter": "adapter"}.get(group or "", "")
    rows: list[list[str]] = []
    for row in report.get("data", []):
        if group == "model":
            name = row.get("model")
        elif group == "adapter":
            name = row.get("adapter") or "(base model)"
        else:
            name = row.get("key_id") or "(no key)"
        rows.append([str(name), *(str(row.get(field, 0)) for field, _ in _COLUMNS)])
    rows.append(["total", *(str(report["totals"].get(field, 0)) for field, _ in _COLUMNS)])
    header = [label or "", *(title for _, title in _COLUMNS)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"usage of tenant {report['tenant']}, {_stamp(report['start'])} to {_stamp(report['end'])}",
        "  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header)),
    ]
    for row in rows:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
    return "\n".join(lines)


def _usage(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {}
    for name in ("start", "end", "group_by"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    client = make_client(args)
    report = _call("usage", lambda: client.get("/usage", cast_to=object, options={"params": params}))
    if not isinstance(report, dict) or "totals" not in report:
        raise BatchCliError(f"usage: unexpected answer from ingress: {str(report)[:200]}", EXIT_BAD_INPUT)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _fail(message: str, code: int) -> NoReturn:
    print(f"sluicegate usage: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _run(args: argparse.Namespace) -> int:
    try:
        return _usage(args)
    except BatchCliError as exc:
        _fail(str(exc), exc.code)


def add_usage_command(sub: argparse._SubParsersAction) -> None:
    """Register ``sluicegate usage`` on the top-level subparsers."""
    usage = sub.add_parser("usage", help="your tenant's token usage (GET /v1/usage), by model or API key")
    usage.add_argument("--start", type=parse_time, help="unix seconds, date or ISO time (default: month start)")
    usage.add_argument("--end", type=parse_time, help="unix seconds, date or ISO time (default: now)")
    usage.add_argument(
        "--group-by", choices=["model", "key", "adapter"], help="a row per model, per API key or per LoRA adapter"
    )
    usage.add_argument("--json", action="store_true", help="the report as JSON")
    usage.add_argument("--base-url", help="OpenAI base URL of ingress (default: SLUICEGATE_API_BASE_URL or local)")
    usage.add_argument("--api-key", help="API key (default: OPENAI_API_KEY, then SLUICEGATE_API_KEY)")
    usage.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP call (default 30)")
    usage.add_argument("--retries", type=int, default=2, help="SDK retries per call (default 2)")
    usage.set_defaults(handler=_run)
