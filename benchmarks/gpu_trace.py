"""Reading the torch profiler's chrome trace of an engine's decode steps: for each step (a ``record_function``
mark named ``STEP_MARK<i>``) its wall and trace times, the union of its device activities (tied to the step by
the CUPTI correlation id of their launch), the host time before its first launch, the gaps between its device
activities and its top kernels; and the trace trimmed to its first steps for keeping. On a CPU trace, with no
device activity, the top lists hold the CPU ops by self time. :mod:`benchmarks.gpu_profile` drives the steps.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

STEP_MARK = "sluicegate_decode_step_"
WARM_MARK = "sluicegate_warm_step"
# Chrome-trace categories of the device's own activities, and of the host calls that launch them.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
# Kernel names of templated GEMMs run to kilobytes; this much tells them apart.
NAME_CHARS = 160
TOP_PER_STEP = 5
TOP_OVERALL = 15


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


def stats(values: Iterable[float | None]) -> dict[str, float | None]:
    """Median, mean and p90 of the values that are not None (all None when there are none)."""
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
    summary: dict[str, Any] = {f: stats(r[f] for r in rows) for f in fields}
    summary["gaps_total_ms"] = stats(r["gaps"]["total_ms"] for r in rows)
    summary["gaps_count"] = stats(r["gaps"]["count"] for r in rows)
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
