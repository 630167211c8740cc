"""Where a decode step's time goes, kernel by kernel: the torch profiler over the engine's decode steps.

For bf16, FP8 and INT4 (AWQ) weights of the Llama-3.1-8B-shaped random checkpoint that ``engine_gpu.py``
builds (``--smoke``: its tiny shape, on the CPU), at concurrency 1 (a 32-token prompt, as engine_gpu's c=1
decode) and 64 (the voice bot's prompts: a 1900-token system prompt served from the prefix cache plus 100
unique tokens), the engine is driven through its public step loop (``add_request``, ``step``) into pure
decode. Then ``--steps`` steps are timed without the profiler (the ITL it does not disturb), and ``--steps``
more under ``torch.profiler`` (CPU activity, and CUDA on a GPU), each step inside a ``record_function``
mark. From the profiler's chrome trace, per step:

- ``itl_ms``: the step's wall time (``perf_counter`` around ``engine.step()``; every request gets one token
  a step, so this is the ITL), and ``trace_step_ms``, the step as the trace saw it;
- ``gpu_busy_ms``: the union of the step's device intervals (kernels, memcpy, memset). A device activity belongs
  to the step whose thread launched it (the CUPTI correlation id ties it to its launch call; a graph replay's
  kernels all carry the replay's id), so the sync at the end of each step is not needed for the attribution;
- ``gpu_idle_ms``: the step minus its busy time: the time the GPU waits for the host within the step;
- ``host_before_first_launch_ms``: from the step's start to its first launch call that puts work on the GPU
  (scheduling and input preparation, during which the GPU has nothing to do), and ``first_kernel_start_ms``
  to the start of that work;
- ``after_last_kernel_ms``: from the end of the step's last device activity to the step's end (the host side
  of sampling, and bookkeeping);
- ``gaps``: the idle gaps between the step's device activities (count, total, largest, and the three largest
  with the activities on either side);
- ``top_kernels``: the step's device activities by total time.

On the CPU there is no device activity: the GPU fields are 0 (busy, gaps) or None (launch times), and the top
lists hold the CPU ops by self time instead, so the rehearsal still exercises every path but the CUDA one
(``tests/unit/engine/test_engine_gpu_bench_smoke.py`` feeds :func:`analyze_trace` a CUDA-shaped trace).

Writes ``$OUT/gpu_profile.json`` (after every configuration, so a run cut short keeps what it measured),
``$OUT/gpu_profile.md`` (a summary table for docs/benchmarks.md) and each configuration's chrome trace,
gzip-compressed and trimmed to its first steps to stay under ``--trace-mb``, into ``--trace-dir`` (default
``$OUT/gpu_profile_traces``); a trace opens in https://ui.perfetto.dev.

Usage: ``PYTHONPATH=. python3 -m benchmarks.gpu_profile --model-dir DIR`` on a GPU (the checkpoints of
``engine_gpu.py --build-only --model-dir DIR`` are reused, or written); ``--smoke`` on the CPU.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import engine_gpu
from gpu_workers.engine import LLMEngine, SamplingParams
from gpu_workers.engine.quantization import weight_memory_bytes

FORMATS = ("bf16", "fp8", "awq")
QUANTIZATION = {"bf16": None, "fp8": "fp8", "awq": "awq"}
STEP_MARK = "sluicegate_decode_step_"
WARM_MARK = "sluicegate_warm_step"
# Chrome-trace categories of the device's own activities, and of the host calls that launch them.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
# Kernel names of templated GEMMs run to kilobytes; this much tells them apart.
NAME_CHARS = 160
TOP_PER_STEP = 5
TOP_OVERALL = 15
# Steps after the prompts are in, before anything is timed: the decode graphs' first replays, the allocator.
WARM_STEPS = 5


@dataclass(frozen=True)
class Interval:
    """One activity on the trace's clock (microseconds)."""

    start: float
    end: float
    name: str


# ---------------------------------------------------------------------------------------------- trace analysis


def _union(intervals: list[Interval]) -> tuple[float, list[tuple[float, str, str]]]:
    """Microseconds covered by ``intervals`` (sorted by start), and the gaps between them as
    (length, activity before, activity after)."""
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    cur_start, cur_end, cur_name = intervals[0].start, intervals[0].end, intervals[0].name
    for iv in intervals[1:]:
        if iv.start > cur_end:
            busy += cur_end - cur_start
            gaps.append((iv.start - cur_end, cur_name, iv.name))
            cur_start, cur_end, cur_name = iv.start, iv.end, iv.name
        elif iv.end > cur_end:
            cur_end, cur_name = iv.end, iv.name
    busy += cur_end - cur_start
    return busy, gaps


def _top(durations: Iterable[tuple[str, float]], limit: int, total_us: float | None = None) -> list[dict[str, Any]]:
    """Names by summed duration: name, ms, count (and share of ``total_us``)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, dur in durations:
        sums[name] += dur
        counts[name] += 1
    rows = []
    for name, us in sorted(sums.items(), key=lambda kv: -kv[1])[:limit]:
        row: dict[str, Any] = {"name": name[:NAME_CHARS], "ms": us / 1e3, "count": counts[name]}
        if total_us:
            row["share"] = us / total_us
        rows.append(row)
    return rows


def _self_times(ops: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(name, start, self microseconds) of CPU ops: each op's duration minus its children's, per thread."""
    out: list[tuple[str, float, float]] = []
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for op in ops:
        by_thread[(op.get("pid"), op.get("tid"))].append(op)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, start, self]
        for op in thread_ops:
            start, end = op["ts"], op["ts"] + op["dur"]
            while stack and stack[-1][0] <= start:
                done = stack.pop()
                out.append((done[1], done[2], done[3]))
            if stack:
                stack[-1][3] -= op["dur"]
            stack.append([end, op["name"], start, op["dur"]])
        out.extend((done[1], done[2], done[3]) for done in stack)
    return out


def _stats(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "mean": None, "p90": None}
    return {
        "p50": statistics.median(vals),
        "mean": statistics.fmean(vals),
        "p90": vals[min(len(vals) - 1, math.ceil(0.9 * len(vals)) - 1)],
    }


def analyze_trace(events: list[dict[str, Any]], walls_ms: list[float] | None = None) -> dict[str, Any]:
    """Per-step rows, a summary and the top activities of a chrome trace whose steps are marked
    ``STEP_MARK + index`` (see the module's docstring for the fields). ``walls_ms[i]`` is step ``i``'s wall
    time measured outside the profiler's mark."""
    marks: list[tuple[float, float, int]] = []
    launches: list[dict[str, Any]] = []
    device: list[dict[str, Any]] = []
    cpu_ops: list[dict[str, Any]] = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if name.startswith(STEP_MARK) and cat != "gpu_user_annotation":
            marks.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(name[len(STEP_MARK) :])))
        elif cat in DEVICE_CATEGORIES:
            device.append(e)
        elif cat in LAUNCH_CATEGORIES:
            launches.append(e)
        elif cat == "cpu_op":
            cpu_ops.append(e)
    marks.sort()
    starts = [m[0] for m in marks]

    def step_of(ts: float) -> int | None:
        """Position in ``marks`` of the step whose window holds ``ts``."""
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts <= marks[i][1] else None

    launch_by_corr = {e.get("args", {}).get("correlation"): e for e in launches}
    launched: set[Any] = set()  # correlation ids of launch calls that put work on the device
    per_step: list[list[Interval]] = [[] for _ in marks]
    unattributed = 0
    for e in device:
        corr = e.get("args", {}).get("correlation")
        launch = launch_by_corr.get(corr) if corr is not None else None
        if launch is not None:
            launched.add(corr)
        # By the launching call's host time; without one (a trace that lost the link), by the activity's own.
        pos = step_of(float(launch["ts"]) if launch is not None else float(e["ts"]))
        if pos is None:
            unattributed += 1
            continue
        start = float(e["ts"])
        per_step[pos].append(Interval(start, start + float(e.get("dur", 0.0)), e.get("name", "?")))
    first_launch: list[float | None] = [None] * len(marks)
    launch_counts = [0] * len(marks)
    for e in launches:
        if e.get("args", {}).get("correlation") not in launched:
            continue  # a sync, an event record, a query: no device work of its own
        pos = step_of(float(e["ts"]))
        if pos is None:
            continue
        launch_counts[pos] += 1
        ts = float(e["ts"])
        if first_launch[pos] is None or ts < first_launch[pos]:
            first_launch[pos] = ts
    op_self = _self_times(cpu_ops) if not device else []

    rows: list[dict[str, Any]] = []
    for pos, (start, end, index) in enumerate(marks):
        intervals = sorted(per_step[pos], key=lambda iv: iv.start)
        step_us = end - start
        row: dict[str, Any] = {
            "step": index,
            "itl_ms": walls_ms[index] if walls_ms is not None and index < len(walls_ms) else None,
            "trace_step_ms": step_us / 1e3,
        }
        fl = first_launch[pos]
        row["host_before_first_launch_ms"] = (fl - start) / 1e3 if fl is not None else None
        if intervals:
            busy, gaps = _union(intervals)
            first = intervals[0].start
            last = max(iv.end for iv in intervals)
            gaps.sort(key=lambda g: -g[0])
            row |= {
                "gpu_busy_ms": busy / 1e3,
                "gpu_idle_ms": max(0.0, step_us - busy) / 1e3,
                "first_kernel_start_ms": (first - start) / 1e3,
                "after_last_kernel_ms": max(0.0, end - last) / 1e3,
                "kernels": len(intervals),
                "launches": launch_counts[pos],
                "gaps": {
                    "count": len(gaps),
                    "total_ms": sum(g[0] for g in gaps) / 1e3,
                    "max_ms": gaps[0][0] / 1e3 if gaps else 0.0,
                    "largest": [
                        {"ms": g[0] / 1e3, "after": g[1][:NAME_CHARS], "before": g[2][:NAME_CHARS]} for g in gaps[:3]
                    ],
                },
                "top_kernels": _top(((iv.name, iv.end - iv.start) for iv in intervals), TOP_PER_STEP),
            }
        else:
            in_step = ((name, dur) for name, ts, dur in op_self if start <= ts <= end)
            row |= {
                "gpu_busy_ms": 0.0,
                "gpu_idle_ms": step_us / 1e3,
                "first_kernel_start_ms": None,
                "after_last_kernel_ms": None,
                "kernels": 0,
                "launches": launch_counts[pos],
                "gaps": {"count": 0, "total_ms": 0.0, "max_ms": 0.0, "largest": []},
                "top_kernels": _top(in_step, TOP_PER_STEP),
            }
        rows.append(row)

    if device:
        windows = [(m[0], m[1]) for m in marks]
        steps_iv = [iv for ivs in per_step for iv in ivs]
        total = sum(iv.end - iv.start for iv in steps_iv)
        top = _top(((iv.name, iv.end - iv.start) for iv in steps_iv), TOP_OVERALL, total)
        top_source = "device activities (share of their summed time)"
    else:
        windows = [(m[0], m[1]) for m in marks]
        in_steps = [(name, dur) for name, ts, dur in op_self if any(a <= ts <= b for a, b in windows)]
        top = _top(in_steps, TOP_OVERALL, sum(d for _, d in in_steps))
        top_source = "CPU ops by self time (no device activity in the trace)"
    fields = (
        "itl_ms",
        "trace_step_ms",
        "gpu_busy_ms",
        "gpu_idle_ms",
        "host_before_first_launch_ms",
        "first_kernel_start_ms",
        "after_last_kernel_ms",
        "kernels",
        "launches",
    )
    summary: dict[str, Any] = {f: _stats(r[f] for r in rows) for f in fields}
    summary["gaps_total_ms"] = _stats(r["gaps"]["total_ms"] for r in rows)
    summary["gaps_count"] = _stats(r["gaps"]["count"] for r in rows)
    return {
        "steps": rows,
        "summary": summary,
        "top_kernels": top,
        "top_kernels_source": top_source,
        "device_activities": len(device),
        "unattributed_device_activities": unattributed,
        "windows": windows,
    }


def trimmed_trace(
    trace: dict[str, Any], windows: list[tuple[float, float]], limit_bytes: int
) -> tuple[bytes, dict[str, int]]:
    """The trace's events of its first steps, gzip-compressed under ``limit_bytes``: as many of the
    ``windows`` (step start, end) as fit, then as many events of the first as fit."""
    events = trace.get("traceEvents", [])
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M" and "ts" in e), key=lambda e: float(e["ts"]))

    def pack(kept: list[dict[str, Any]]) -> bytes:
        doc = {k: v for k, v in trace.items() if k != "traceEvents"}
        doc["traceEvents"] = meta + kept
        return gzip.compress(json.dumps(doc).encode(), compresslevel=6)

    keep = len(windows)
    while keep >= 1:
        lo, hi = windows[0][0], windows[keep - 1][1]
        kept = [e for e in timed if lo <= float(e["ts"]) <= hi]
        blob = pack(kept)
        if len(blob) <= limit_bytes:
            return blob, {"steps_kept": keep, "events_kept": len(kept), "bytes": len(blob)}
        keep //= 2
    # Not even one step fits: the first events of the first step, as many as fit (halving).
    lo, hi = windows[0] if windows else (-math.inf, math.inf)
    kept = [e for e in timed if lo <= float(e["ts"]) <= hi]
    while kept:
        kept = kept[: len(kept) // 2]
        blob = pack(kept)
        if len(blob) <= limit_bytes:
            return blob, {"steps_kept": 0, "events_kept": len(kept), "bytes": len(blob)}
    blob = pack([])
    return blob, {"steps_kept": 0, "events_kept": 0, "bytes": len(blob)}


# ---------------------------------------------------------------------------------------------- driving the engine


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _step(engine: LLMEngine) -> int:
    """One engine step; the tokens it emitted."""
    return sum(len(d.token_ids) for d in engine.step())


def into_decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Submit ``prompts`` and step until every request has its first token, so that every later step is a
    pure decode step of all of them. The first goes alone, so its prompt's blocks are in the prefix cache
    before the others (which share its system prompt) are scheduled."""
    params = _params(max_tokens)
    ids = [engine.add_request(prompts[0], params)]
    while _step(engine) == 0:
        pass
    ids += [engine.add_request(p, params) for p in prompts[1:]]
    seen: set[str] = {ids[0]}
    while len(seen) < len(ids):
        seen.update(d.request_id for d in engine.step() if d.token_ids)
    return ids


def workload(setup: engine_gpu.Setup, concurrency: int) -> tuple[list[list[int]], str]:
    """The prompts of one concurrency, and what they are."""
    if concurrency == 1:
        rng = random.Random(2)
        return [[rng.randrange(3, setup.vocab) for _ in range(32)]], "one 32-token prompt"
    prompts = engine_gpu.voice_prompts(setup, seed=1)
    return [next(prompts) for _ in range(concurrency)], (
        f"{concurrency} voice-bot prompts: a shared {setup.system_len}-token system prompt (prefix cache) "
        f"+ {setup.unique_len} unique tokens"
    )


def profile_config(
    engine: LLMEngine, setup: engine_gpu.Setup, concurrency: int, steps: int, trace_path: Path, trace_bytes: int
) -> dict[str, Any]:
    """Drive ``concurrency`` requests into decode, time ``steps`` steps, then profile ``steps`` more."""
    from torch.profiler import ProfilerActivity, profile, record_function

    prompts, described = workload(setup, concurrency)
    ids = into_decode(engine, prompts, max_tokens=WARM_STEPS + 2 * steps + 32)
    try:
        for _ in range(WARM_STEPS):
            _step(engine)
        unprofiled: list[float] = []
        for _ in range(steps):
            start = time.perf_counter()
            _step(engine)
            unprofiled.append(1e3 * (time.perf_counter() - start))
        activities = [ProfilerActivity.CPU]
        if setup.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        walls: list[float] = []
        tokens: list[int] = []
        with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
            with record_function(WARM_MARK):  # the profiler's own first-step costs land here, not in a row
                _step(engine)
            for i in range(steps):
                start = time.perf_counter()
                with record_function(f"{STEP_MARK}{i}"):
                    n = _step(engine)
                walls.append(1e3 * (time.perf_counter() - start))
                tokens.append(n)
    finally:
        for rid in ids:
            engine.abort_request(rid)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
    analysis = analyze_trace(trace.get("traceEvents", []), walls)
    for row in analysis["steps"]:
        row["tokens"] = tokens[row["step"]] if row["step"] < len(tokens) else None
    blob, kept = trimmed_trace(trace, analysis.pop("windows"), trace_bytes)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    trace_path.write_bytes(blob)
    return {
        "concurrency": concurrency,
        "workload": described,
        "itl_unprofiled_ms": _stats(unprofiled),
        **analysis,
        "trace": {"file": trace_path.name, **kept},
    }


# ---------------------------------------------------------------------------------------------- report


def _ms(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    """The summary table (medians over the profiled steps) and each configuration's top kernels."""
    lines = [
        "## Decode step profile (benchmarks/gpu_profile.py)",
        "",
        f"{doc['device']}, torch {doc['torch']}, {doc['date']}; {doc['model_label']}; {doc['steps']} profiled decode "
        f"steps per row after {doc['steps']} unprofiled ones, medians over the steps (ms). Copy bandwidth "
        f"{_ms(doc.get('bandwidth_gb_s'), 0)} GB/s; floor = weights a step reads (LM head in bf16) / bandwidth.",
        "",
        "| weights | c | ITL | ITL profiled | floor | GPU busy | busy / floor | GPU idle | host before 1st launch "
        "| after last kernel | gaps (n / ms) | kernels | launches |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cfg in doc["configs"]:
        for run in cfg.get("runs", []):
            s = run["summary"]
            busy = s["gpu_busy_ms"]["p50"]
            floor = cfg.get("floor_ms")
            ratio = busy / floor if busy and floor else None
            lines.append(
                f"| {cfg['format']} | {run['concurrency']} | {_ms(run['itl_unprofiled_ms']['p50'])} "
                f"| {_ms(s['itl_ms']['p50'])} | {_ms(floor)} | {_ms(busy)} | {_ms(ratio) + ('x' if ratio else '')} "
                f"| {_ms(s['gpu_idle_ms']['p50'])} | {_ms(s['host_before_first_launch_ms']['p50'])} "
                f"| {_ms(s['after_last_kernel_ms']['p50'])} "
                f"| {_ms(s['gaps_count']['p50'], 0)} / {_ms(s['gaps_total_ms']['p50'])} "
                f"| {_ms(s['kernels']['p50'], 0)} | {_ms(s['launches']['p50'], 0)} |"
            )
    for cfg in doc["configs"]:
        for run in cfg.get("runs", []):
            lines += ["", f"Top of {cfg['format']}, c={run['concurrency']} ({run['top_kernels_source']}):", ""]
            for k in run["top_kernels"][:8]:
                share = f", {100 * k['share']:.1f} %" if "share" in k else ""
                lines.append(f"- `{k['name'][:100]}`: {k['ms']:.2f} ms over {k['count']} calls{share}")
    if doc["errors"]:
        lines += ["", "Failed: " + "; ".join(doc["errors"])]
    if doc["skipped"]:
        lines += ["", "Skipped: " + "; ".join(doc["skipped"])]
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out_dir: Path | None, *, final: bool) -> None:
    """``gpu_profile.json`` and ``gpu_profile.md`` into ``out_dir`` (each replaced whole: a kill mid-write
    leaves the previous one)."""
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("gpu_profile.json", json.dumps({**doc, "partial": not final}, indent=1)),
        ("gpu_profile.md", markdown(doc)),
    ):
        staging = out_dir / (name + ".tmp")
        staging.write_text(text)
        staging.replace(out_dir / name)


# ---------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    setup = engine_gpu.smoke_setup(120.0) if args.smoke else engine_gpu.full_setup(510.0)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    trace_dir = args.trace_dir or (out_dir / "gpu_profile_traces" if out_dir else Path("gpu_profile_traces"))
    start = time.perf_counter()
    m = setup.shape()
    doc: dict[str, Any] = {
        "smoke": setup.smoke,
        "device": torch.cuda.get_device_name() if setup.device == "cuda" else "CPU",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "model": m,
        "model_label": (
            f"random-weight Llama, {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}, {m['dtype']}"
        ),
        "steps": args.steps,
        "activities": ["CPU", "CUDA"] if setup.device == "cuda" else ["CPU"],
        "configs": [],
        "errors": [],
        "skipped": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_dir or Path(tmp) / "model"
        engine_gpu.build_checkpoint(setup, path)
        bandwidth = engine_gpu.copy_bandwidth(setup)
        engine_gpu.free_engine(setup)  # hands the copy's cached blocks back before the engine sizes its KV cache
        doc["bandwidth_gb_s"] = bandwidth / 1e9
        per_format_s: list[float] = []
        for fmt in args.formats:
            # The next format needs about what the slowest one before it took (engine load dominates).
            need = max(per_format_s, default=0.0)
            if args.budget_s and time.perf_counter() - start + need > args.budget_s:
                doc["skipped"].append(f"{fmt}: needs ~{need:.0f} s, the budget has {args.budget_s:.0f} s in all")
                continue
            began = time.perf_counter()
            cfg: dict[str, Any] = {"format": fmt, "runs": []}
            doc["configs"].append(cfg)
            engine = None
            try:
                model_path = engine_gpu.int4_checkpoint(setup, path, fmt) if fmt == "awq" else path
                engine = engine_gpu.make_engine(
                    setup, model_path, quantization=QUANTIZATION[fmt], max_num_seqs=max(args.concurrency)
                )
                model = engine.loaded.model
                graphs = engine.runner.decode_graphs
                cfg |= {
                    "weight_bytes": weight_memory_bytes(model),
                    "floor_bytes": engine_gpu.floor_bytes(model),
                    "floor_ms": 1e3 * engine_gpu.floor_bytes(model) / bandwidth,
                    "attention_backend": engine.attention_backend_name,
                    "decode_graphs": graphs.num_captured if graphs else 0,
                }
                for c in args.concurrency:
                    trace_path = trace_dir / f"{fmt}_c{c}.json.gz"
                    cfg["runs"].append(
                        profile_config(engine, setup, c, args.steps, trace_path, int(args.trace_mb * 2**20))
                    )
                    s = cfg["runs"][-1]["summary"]
                    engine_gpu.log(
                        f"{fmt} c={c}: ITL p50 {_ms(s['itl_ms']['p50'])} ms, GPU busy {_ms(s['gpu_busy_ms']['p50'])} "
                        f"ms, host before first launch {_ms(s['host_before_first_launch_ms']['p50'])} ms"
                    )
                    write(doc, out_dir, final=False)
            except Exception as exc:  # one format's failure must not cost the others' profiles
                traceback.print_exc()
                doc["errors"].append(f"{fmt}: {exc!r}")
            finally:
                del engine
                engine_gpu.free_engine(setup)
                per_format_s.append(time.perf_counter() - began)
                write(doc, out_dir, final=False)
    doc["elapsed_s"] = time.perf_counter() - start
    doc["trace_dir"] = str(trace_dir)
    write(doc, out_dir, final=True)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (CPU activity only)")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse/keep the checkpoints here")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 64 (smoke: 1 8)")
    parser.add_argument("--steps", type=int, default=None, help="profiled decode steps (default 50, smoke 12)")
    parser.add_argument("--trace-dir", type=Path, default=None, help="default $OUT/gpu_profile_traces")
    parser.add_argument("--trace-mb", type=float, default=2.0, help="size bound of each compressed trace")
    parser.add_argument("--budget-s", type=float, default=None, help="skip the formats that would not fit")
    args = parser.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    if unknown := set(args.formats) - set(FORMATS):
        parser.error(f"unknown format(s): {', '.join(sorted(unknown))}")
    if args.smoke:
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        parser.error("profiling the 8B shape needs a CUDA GPU; use --smoke on a CPU")
    args.concurrency = args.concurrency or ([1, 8] if args.smoke else [1, 64])
    args.steps = args.steps or (12 if args.smoke else 50)
    doc = run(args)
    print(markdown(doc))
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
