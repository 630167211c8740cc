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
(``tests/unit/engine/test_engine_gpu_bench_smoke.py`` feeds :func:`benchmarks.gpu_trace.analyze_trace` a
CUDA-shaped trace).

Writes ``$OUT/gpu_profile.json`` (after every configuration, so a run cut short keeps what it measured),
``$OUT/gpu_profile.md`` (a summary table for docs/benchmarks.md) and each configuration's chrome trace,
gzip-compressed and trimmed to its first steps to stay under ``--trace-mb``, into ``--trace-dir`` (default
``$OUT/gpu_profile_traces``); a trace opens in https://ui.perfetto.dev.

Usage: ``PYTHONPATH=. python3 -m benchmarks.gpu_profile --model-dir DIR`` on a GPU (the checkpoints of
``engine_gpu.py --build-only --model-dir DIR`` are reused, or written); ``--smoke`` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import engine_gpu
from benchmarks.gpu_trace import STEP_MARK, WARM_MARK, analyze_trace, stats, trimmed_trace
from gpu_workers.engine import LLMEngine, SamplingParams
from gpu_workers.engine.quantization import weight_memory_bytes

FORMATS = ("bf16", "fp8", "awq")
QUANTIZATION = {"bf16": None, "fp8": "fp8", "awq": "awq"}
# Steps after the prompts are in, before anything is timed: the decode graphs' first replays, the allocator.
WARM_STEPS = 5


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
        "itl_unprofiled_ms": stats(unprofiled),
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
