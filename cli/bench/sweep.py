"""``sluicegate bench``'s sweep: the OpenAI-compatible target, the runs of a sweep and the report (the workload,
statistics and levels are in :mod:`cli.bench.measure`, the flags in :mod:`cli.bench.command`, the native,
Kafka-native and batch targets in :mod:`cli.bench.native`, :mod:`cli.bench.kafka` and :mod:`cli.bench.batch`).

* ``openai``: ``POST {base}/chat/completions`` (or ``/completions``) over ``httpx``, streamed with
  ``stream_options.include_usage`` so the token counts are the server's own; TTFT is the first content chunk,
  ITL the gaps between content chunks. Any OpenAI-compatible server works.
* ``native``: ``POST {base}/requests``, then the request's stream on one multiplexed WebSocket of the result
  service (``/v1/streams``) kept for the run (:mod:`cli.bench.native`).
* ``kafka``: an :class:`~schemas.InferenceRequest` per prompt produced to ``llm.inbound`` (acknowledged, as a
  Kafka-native producer does), then the request's Redis stream (``llm:stream:<id>``) read with ``XREAD BLOCK``
  until its ``done``/``error`` event; TTFT is produce-sent to the first token entry, counts from ``done``'s usage.
* ``batch``: the prompts as one Batch API job (upload, create, poll); lines/s and how far the batch's
  ``eta_seconds``, seen when a tenth of the lines are done, was from the finish the client then saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from cli.bench.batch import batch_table, run_batch
from cli.bench.kafka import KafkaTarget
from cli.bench.measure import (
    EXIT_NO_SUCCESS,
    BenchError,
    Prompt,
    Sample,
    Slo,
    api_error,
    drive,
    load_prompts,
    parse_levels,
    progress_bar,
    render_table,
    request_body,
    summarize,
    unreachable,
)
from cli.bench.native import NativeTarget
from sluicegate.settings import get_settings

#: How long ``GET /models`` may take before the server counts as unreachable (``--timeout`` is per request).
PREFLIGHT_TIMEOUT_S = 30.0

# --- the OpenAI-compatible path ------------------------------------------------------------------------------


class OpenAITarget:
    """Streams (or not) chat or text completions from one OpenAI-compatible server."""

    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient) -> None:
        self.args = args
        self.client = client
        self.model: str = args.model or ""

    async def preflight(self) -> None:
        """``GET /models``: the server answers, the key is taken, the model exists (the first one by default)."""
        try:
            response = await self.client.get("models", timeout=PREFLIGHT_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise unreachable(str(self.client.base_url), exc) from exc
        if response.status_code in (401, 403):
            raise BenchError(f"{self.client.base_url}models: {api_error(response)} (check --api-key)")
        if response.status_code == 404 and not self.client.base_url.path.rstrip("/").endswith("/v1"):
            # The server root given where its /v1 was meant (as vllm bench serve takes it): said when /v1 answers.
            # A server under another prefix, with no model listing, is measured as before.
            hint = str(self.client.base_url).rstrip("/") + "/v1"
            with contextlib.suppress(httpx.HTTPError):
                if (await self.client.get(f"{hint}/models", timeout=PREFLIGHT_TIMEOUT_S)).status_code == 200:
                    raise BenchError(f"{self.client.base_url}models: 404 Not Found; the API is at {hint}: pass that")
        if response.status_code != 200:
            return  # some servers have no model listing: the first request will say what is wrong
        served = [m.get("id") for m in response.json().get("data", []) if isinstance(m, dict)]
        if not self.model:
            if not served:
                raise BenchError(f"{self.client.base_url}models lists no model: pass --model")
            self.model = served[0]
        elif served and self.model not in served:
            raise BenchError(f"unknown model {self.model!r}: {self.client.base_url} serves {', '.join(served)}")

    async def send(self, prompt: Prompt, sample: Sample) -> None:
        """One request; ``--timeout`` bounds all of it (httpx's own timeout bounds each read only)."""
        try:
            async with asyncio.timeout(self.args.timeout):
                await self._send(prompt, sample)
        except TimeoutError:
            sample.error = f"no answer within {self.args.timeout:g} s (--timeout)"

    async def _send(self, prompt: Prompt, sample: Sample) -> None:
        path, body = request_body(self.args, self.model, prompt, stream=self.args.stream)
        if not self.args.stream:
            response = await self.client.post(path, json=body)
            sample.e2e = time.monotonic() - sample.sent
            if response.status_code != 200:
                sample.error = api_error(response)
                return
            self._usage(sample, response.json().get("usage"))
            return
        chunks = 0
        finish_at: float | None = None  # the first chunk that ends a choice: the TTFT of a reply with no content
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                sample.error = api_error(response)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    sample.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"[:200]
                    return
                self._usage(sample, chunk.get("usage"))
                choices = chunk.get("choices") or ()
                if any(self._content(choice) for choice in choices):
                    sample.content_at(time.monotonic())
                    chunks += 1
                elif finish_at is None and any(choice.get("finish_reason") for choice in choices):
                    finish_at = time.monotonic()
        sample.e2e = time.monotonic() - sample.sent
        if sample.ttft is None and finish_at is not None:
            sample.ttft = finish_at - sample.sent
        if not sample.output_tokens:
            sample.output_tokens = chunks  # no usage chunk: a content chunk per token, as most servers send

    @staticmethod
    def _content(choice: dict[str, Any]) -> bool:
        delta = choice.get("delta") or {}
        return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content"))

    @staticmethod
    def _usage(sample: Sample, usage: dict[str, Any] | None) -> None:
        if usage:
            sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            sample.output_tokens = int(usage.get("completion_tokens") or 0)


# --- the command --------------------------------------------------------------------------------------------------


def _base_url(args: argparse.Namespace) -> str:
    settings = get_settings()
    url = args.base_url or settings.api_base_url or f"http://127.0.0.1:{settings.ingress_port}/v1"
    return url.rstrip("/") + "/"


def _api_key(args: argparse.Namespace) -> str:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or get_settings().api_key or "EMPTY"


def _client(args: argparse.Namespace, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=_base_url(args),
        headers={"Authorization": f"Bearer {_api_key(args)}"},
        # No read timeout: --timeout bounds each whole request (OpenAITarget.send), and a read timeout would race it.
        timeout=httpx.Timeout(None, connect=10),
        limits=httpx.Limits(max_connections=connections),
    )


async def _model_of(args: argparse.Namespace) -> str:
    """The model a batch runs on: ``--model`` checked against ``GET /models``, else the server's first."""
    async with _client(args, 1) as http:
        target = OpenAITarget(args, http)
        await target.preflight()
    return target.model


def _check_flags(args: argparse.Namespace) -> None:
    """Everything the flags alone can get wrong, before any load is sent (a bad ``--json`` path included)."""
    for flag in ("num_prompts", "output_len", "input_len", "max_concurrency"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("timeout", "poll_interval", "slo_ttft_ms", "slo_itl_ms", "slo_e2e_ms"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BenchError(f"--{flag.replace('_', '-')} must be a positive number, got {value:g}")
    if args.json is not None:
        if args.json.is_dir():
            raise BenchError(f"--json {args.json}: is a directory, not a file")
        if not args.json.parent.is_dir():
            raise BenchError(f"--json {args.json}: no directory {args.json.parent}")
    if not args.stream and args.slo_ttft_ms is not None:
        raise BenchError("--slo-ttft-ms needs streaming (TTFT is not seen with --no-stream)")
    if args.target == "native" and not args.stream:
        raise BenchError("--target native always streams (its requests are followed on the result service)")
    if args.target == "batch" and (args.rate or args.concurrency):
        raise BenchError("--target batch sends one batch: --rate and --concurrency do not apply")


async def _sweep(args: argparse.Namespace, prompts: list[Prompt], slo: Slo, runs: list[dict[str, Any]]) -> None:
    """Each level's run, appended to ``runs`` as it ends: a level that fails whole, or Ctrl-C, keeps the others."""
    rates = parse_levels(args.rate, "--rate", integer=False)
    levels: list[tuple[int | None, float | None]] = (
        [(args.max_concurrency, r) for r in rates]
        if rates
        else [(int(c), None) for c in parse_levels(args.concurrency, "--concurrency", integer=True) or [1]]
    )
    async with _client(args, max((c or len(prompts)) for c, _ in levels)) as http:
        target: OpenAITarget | KafkaTarget | NativeTarget
        if args.target == "kafka":
            target = KafkaTarget(args)
        else:
            target = OpenAITarget(args, http)
            await target.preflight()
            if args.target == "native":
                args.model = target.model
                target = NativeTarget(args, http)
        try:
            if isinstance(target, KafkaTarget):
                await target.start()  # in here: a refused start (or Ctrl-C in it) still closes what it opened
            args.model = target.model
            for concurrency, rate in levels:
                label = f"rate {rate:g}/s" if rate else f"concurrency {concurrency}"
                run = await _one_run(args, target, prompts, slo, label, concurrency, rate)
                runs.append(run)
                if not run["completed"]:
                    first = next(iter(run["errors"]), "no answer")
                    raise BenchError(f"{label}: all {run['requests']} requests failed, e.g. {first}", EXIT_NO_SUCCESS)
        finally:
            if isinstance(target, KafkaTarget | NativeTarget):
                await target.close()


async def _one_run(
    args: argparse.Namespace,
    target: OpenAITarget | KafkaTarget | NativeTarget,
    prompts: list[Prompt],
    slo: Slo,
    label: str,
    concurrency: int | None,
    rate: float | None,
) -> dict[str, Any]:
    bar = progress_bar() if not args.no_progress else None
    with bar or nullcontext():
        task = bar.add_task(label, total=len(prompts), failed=0, rate="") if bar else None
        started, tally = time.monotonic(), {"done": 0, "failed": 0}

        def done(sample: Sample) -> None:
            tally["done"] += 1
            tally["failed"] += not sample.ok
            if bar is not None and task is not None:
                rate = f"{tally['done'] / (time.monotonic() - started):.2f} req/s"
                bar.update(task, advance=1, failed=tally["failed"], rate=rate)

        samples, duration = await drive(
            prompts, target.send, concurrency=concurrency, rate=rate, seed=args.seed, on_done=done
        )
    return summarize(samples, duration, slo, label=label, concurrency=concurrency, rate=rate)


def run_bench(args: argparse.Namespace) -> int:
    """``sluicegate bench``: the sweep (or the batch), the table on stdout and ``--json``."""
    from rich.console import Console

    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
    # A broker that goes away mid-run makes aiokafka log every reconnect (thousands of lines a minute); the
    # requests it fails are counted and named in the table, and an unreachable broker is the one-line error.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    _check_flags(args)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_e2e_ms)
    prompts = load_prompts(
        args.num_prompts, dataset=args.dataset, input_len=args.input_len, output_len=args.output_len, seed=args.seed
    )
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    report: dict[str, Any] = {
        "tool": "sluicegate bench",
        "started_at": started_at,
        "target": args.target,
        "endpoint": args.endpoint,
        "stream": args.stream,
        "dataset": f"synthetic {args.input_len} words" if args.input_len else str(args.dataset or "shipped prompts"),
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "slo": slo.as_dict(),
    }
    console = Console(width=max(160, Console().width))
    if args.target == "batch":
        args.model = asyncio.run(_model_of(args))
        batch = run_batch(args, _base_url(args), _api_key(args), prompts)
        # A batch is not streamed and has no SLO: the report says neither.
        report = {k: v for k, v in report.items() if k not in ("stream", "slo")}
        report |= {"base_url": _base_url(args), "model": args.model, "batch": batch}
        console.print(batch_table(batch))
        _write_json(args.json, report)
        return 0
    runs: list[dict[str, Any]] = []
    report["base_url"] = _base_url(args) if args.target in ("openai", "native") else None

    def show(**extra: Any) -> None:
        console.print(render_table(runs, slo))
        _write_json(args.json, report | {"model": args.model, "runs": runs} | extra)

    try:
        asyncio.run(_sweep(args, prompts, slo, runs))
    except (BenchError, KeyboardInterrupt) as exc:
        # What finished is still shown and saved, marked incomplete; the error (or 130) follows.
        if runs:
            show(incomplete="interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc))
        raise
    show()
    return 0


def _finite(value: Any) -> Any:
    """``value`` with every infinite float written as vLLM's bench writes it ("inf") and NaN as null: JSON has
    neither, and ``json.dumps`` would write ``Infinity``, which other parsers refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False) + "\n")
