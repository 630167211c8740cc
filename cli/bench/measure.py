"""What ``sluicegate bench`` measures, shared by its targets: the prompts of a run, one request's timings
(:class:`Sample`), SLOs and goodput, the summary of a run, the sweep driver and the table it prints.

The command itself (flags, exit codes) is :mod:`cli.bench.command`; the targets that send requests are
:mod:`cli.bench.sweep` (OpenAI-compatible), :mod:`cli.bench.native`, :mod:`cli.bench.kafka` and :mod:`cli.bench.batch`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

DEFAULT_DATASET = Path(__file__).resolve().parent / "data" / "bench_prompts.jsonl"
EXIT_NO_SUCCESS = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
QUANTILES = (0.5, 0.9, 0.95, 0.99)
#: Words of synthetic prompts: common, short English words (most are one token in any BPE vocabulary).
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by word but what some "
    "we can out other were all there when up use your how said an each she which do their time if will way about "
    "many then them write would like so these her long make thing see him two has look more day could go come"
).split()


class BenchError(Exception):
    """An error reported as one line on stderr; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


# --- workload ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One request's input text and the number of tokens to ask for."""

    text: str
    max_tokens: int


def load_prompts(
    count: int, *, dataset: Path | None, input_len: int | None, output_len: int, seed: int = 0
) -> list[Prompt]:
    """``count`` prompts: synthetic ones of ``input_len`` words, else the dataset's lines cycled in a seeded
    shuffle. A dataset line is ``{"prompt": "..."}`` (``"max_tokens"`` optional, else ``output_len``)."""
    rng = random.Random(seed)
    if input_len is not None:
        return [Prompt(" ".join(rng.choice(_WORDS) for _ in range(input_len)), output_len) for _ in range(count)]
    path = dataset or DEFAULT_DATASET
    try:
        raw = path.read_text().splitlines()
    except OSError as exc:
        raise BenchError(f"dataset {path}: {exc.strerror or exc}") from exc
    pool: list[Prompt] = []
    for number, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pool.append(Prompt(str(row["prompt"]), int(row.get("max_tokens", output_len))))
        except (ValueError, KeyError, TypeError) as exc:
            raise BenchError(f'dataset {path} line {number}: expected {{"prompt": ...}} ({exc})') from exc
    if not pool:
        raise BenchError(f"dataset {path} has no prompts")
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]


def request_body(args: argparse.Namespace, model: str, prompt: Prompt, *, stream: bool) -> tuple[str, dict[str, Any]]:
    """The OpenAI request for ``prompt``: its path under the base URL (``chat/completions`` or ``completions``)
    and body; a stream asks for the usage chunk (``stream_options.include_usage``) so token counts are the
    server's."""
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens, "temperature": args.temperature}
    if args.endpoint == "chat":
        path, body["messages"] = "chat/completions", [{"role": "user", "content": prompt.text}]
    else:
        path, body["prompt"] = "completions", prompt.text
    if args.ignore_eos:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return path, body


def api_error(response: httpx.Response) -> str:
    """The server's one-line message for a non-2xx answer (OpenAI's error shape, else the body's start)."""
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
    except ValueError:
        message = None
    return f"{response.status_code} {message or response.text[:200].strip() or response.reason_phrase}"


# --- what one request measured --------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One request as the client saw it (seconds on the monotonic clock; ``ttft`` None when not streamed)."""

    sent: float = 0.0
    ttft: float | None = None
    #: Gaps between successive content chunks (or stream entries) after the first.
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    #: When the last content arrived (for the next ITL).
    last_content_at: float | None = field(default=None, init=False, repr=False)

    def content_at(self, now: float) -> None:
        """Content (a chunk or token event) arrived at ``now``: the first gives TTFT, each later one an ITL."""
        if self.ttft is None or self.last_content_at is None:
            self.ttft = now - self.sent
        else:
            self.itls.append(now - self.last_content_at)
        self.last_content_at = now

    def ended(self, now: float) -> None:
        """The request ended at ``now``. A reply with no content at all (its first token was the end of text) was
        first answered by its end: that is its TTFT, as vLLM's first chunk with a choice is."""
        self.e2e = now - self.sent
        if self.ttft is None:
            self.ttft = self.e2e

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds (None: not checked). A request is good when it meets every one."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, sample: Sample) -> bool:
        """Whether ``sample`` succeeded within every objective (a one-token reply has no inter-token time: it
        meets an ITL objective, as in vLLM; without streaming there is no TTFT, so a TTFT objective fails)."""
        if not sample.ok or sample.e2e is None:
            return False
        if self.ttft_ms is not None and (sample.ttft is None or 1000 * sample.ttft > self.ttft_ms):
            return False
        tpot = sample.tpot
        if self.itl_ms is not None and sample.output_tokens >= 2 and (tpot is None or 1000 * tpot > self.itl_ms):
            return False
        return self.e2e_ms is None or 1000 * sample.e2e <= self.e2e_ms

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms, "e2e_ms": self.e2e_ms}


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between ranks (numpy's default, as vLLM reports); NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None where there is no value, so the JSON stays valid)."""
    values = [1000 * v for v in values_s]
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = quantile(values, q) if values else None
    return out


def summarize(samples: Sequence[Sample], duration_s: float, slo: Slo, **labels: Any) -> dict[str, Any]:
    """One run's figures, as the table and ``--json`` show them."""
    ok = [s for s in samples if s.ok]
    output_tokens = sum(s.output_tokens for s in ok)
    input_tokens = sum(s.prompt_tokens for s in ok)
    good = sum(1 for s in ok if slo.met(s))
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return {
        **labels,
        "requests": len(samples),
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "ttft_ms": distribution_ms([s.ttft for s in ok if s.ttft is not None]),
        "itl_ms": distribution_ms([gap for s in ok for gap in s.itls]),
        "tpot_ms": distribution_ms([t for s in ok if (t := s.tpot) is not None]),
        "e2e_ms": distribution_ms([s.e2e for s in ok if s.e2e is not None]),
        "good_requests": good,
        "goodput": good * per_s,
        "errors": dict(Counter(s.error for s in samples if s.error).most_common(5)),
    }


# --- driving the load -----------------------------------------------------------------------------------------------

Send = Callable[[Prompt, Sample], Awaitable[None]]


async def drive(
    prompts: Sequence[Prompt],
    send: Send,
    *,
    concurrency: int | None,
    rate: float | None,
    seed: int = 0,
    on_done: Callable[[Sample], None] | None = None,
) -> tuple[list[Sample], float]:
    """Send every prompt through ``send`` with at most ``concurrency`` in flight and, with ``rate``, Poisson
    arrivals at that many a second; the samples and the run's wall time (first send to last answer)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    samples = [Sample() for _ in prompts]
    start = time.monotonic()
    offsets, at = [], 0.0
    for _ in prompts:
        offsets.append(at)
        if rate and math.isfinite(rate):
            at += rng.expovariate(rate)

    async def one(prompt: Prompt, sample: Sample, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        if gate is not None:
            await gate.acquire()
        try:
            sample.sent = time.monotonic()
            try:
                await send(prompt, sample)
            except BenchError:
                raise
            except Exception as exc:  # one failed request is a figure of the run, not the end of it
                sample.error = sample.error or f"{type(exc).__name__}: {exc}"[:200]
        finally:
            if gate is not None:
                gate.release()
            if on_done is not None:
                on_done(sample)

    await asyncio.gather(*(one(p, s, o) for p, s, o in zip(prompts, samples, offsets, strict=True)))
    return samples, time.monotonic() - start


def progress_bar() -> Any:
    """A ``rich`` progress bar on stderr: finished of total, failures, requests/s and elapsed time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]}[/] failed"),
        TextColumn("[cyan]{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


# --- reporting --------------------------------------------------------------------------------------------------


def _ms(dist: dict[str, float | None], key: str) -> str:
    value = dist.get(key)
    return "-" if value is None else f"{value:,.1f}"


def render_table(runs: Sequence[dict[str, Any]], slo: Slo) -> Any:
    """The sweep as a ``rich`` table, one row per run."""
    from rich.table import Table

    table = Table(title="sluicegate bench")
    for column in (
        "run", "ok/fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50",
        "E2E p50", "E2E p99", "goodput req/s",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column == "run" else "right")
    for run in runs:
        table.add_row(
            run["label"],
            f"{run['completed']}/{run['failed']}",
            f"{run['request_throughput']:,.2f}",
            f"{run['output_throughput']:,.1f}",
            _ms(run["ttft_ms"], "p50"),
            _ms(run["ttft_ms"], "p99"),
            _ms(run["itl_ms"], "p50"),
            _ms(run["itl_ms"], "p99"),
            _ms(run["tpot_ms"], "p50"),
            _ms(run["e2e_ms"], "p50"),
            _ms(run["e2e_ms"], "p99"),
            f"{run['goodput']:,.2f} ({run['good_requests']})",
        )
    slos = ", ".join(f"{k} <= {v:g}" for k, v in slo.as_dict().items() if v is not None)
    table.caption = f"latencies in ms; goodput: requests meeting {slos}" if slos else "latencies in ms; no SLO given"
    return table


def unreachable(what: str, exc: BaseException) -> BenchError:
    """The one-line error for a server, broker or Redis that does not answer (exit 3)."""
    text, name = str(exc), exc.__class__.__name__
    # aiokafka's errors already start with their class name; others are given it once.
    return BenchError(f"cannot reach {what} ({text if text.startswith(name) else f'{name}: {text}'})", EXIT_UNREACHABLE)


def parse_levels(text: str | None, flag: str, *, integer: bool) -> list[float]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; every level positive (``inf`` allowed for ``--rate``)."""
    if text is None:
        return []
    levels = []
    for part in text.split(","):
        try:
            value = int(part) if integer else float(part)
        except ValueError:
            raise BenchError(f"{flag} takes a comma-separated list of positive numbers, got {text!r}") from None
        if not value > 0:
            raise BenchError(f"{flag} levels must be positive, got {part!r}")
        levels.append(value)
    return levels
