"""The GPU benchmark scripts run end to end in their CPU smoke mode (tiny model, same code path), so
they cannot rot between GPU runs; the profile's trace analysis is checked on a CUDA-shaped trace."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.arch_parity import checkpoint_args, passed
from benchmarks.gpu_trace import STEP_MARK, analyze_trace, trimmed_trace
from gpu_workers.engine.models import ARCHITECTURE_INFO

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_engine_gpu_benchmark_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the smoke run uses the torch backend on CPU
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "engine_gpu.py"), "--smoke"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "## Engine on one GPU" in result.stdout and "Targets" in result.stdout

    results = json.loads((tmp_path / "engine_gpu.json").read_text())
    assert results["smoke"] is True and not results["budget_skipped"]
    assert results["floor"]["floor_ms"] > 0 and results["decode_c1"]["itl_p50_ms"] > 0
    sweep = results["voice_bot"]
    assert [row["concurrency"] for row in sweep] == [1, 2, 4]
    for row in sweep:
        assert row["complete"] and row["requests"] >= 4
        assert math.isfinite(row["ttft_p99_ms"]) and math.isfinite(row["itl_p99_ms"]) and row["output_tok_s"] > 0
        # Every request after the warm-up reuses the cached system prompt.
        assert row["prefix_hit_rate"] > 0.5
    assert results["prefix_off"][0]["prefix_hit_rate"] == 0.0
    peers = results["peers"]
    assert set(peers["ours"]) == {"1", "4"} and set(peers["hf_generate"]) == {"1", "4"}
    assert set(peers["hf_cb"]) == {"1", "4"} and all(r["complete"] for r in peers["hf_cb"].values())
    # Tensor parallelism (2 ranks under gloo in the smoke run) keeps greedy output equal.
    assert results["tensor_parallel"]["greedy_equal"] is True
    # Draft-model speculation (the target's first layers as the draft) ran and kept greedy output exact.
    assert results["spec_draft_model"]["c1"]["verification_steps"] > 0
    # Multi-LoRA through the engine: base and adapter rows at c=1 and c=8, eager here (no CUDA graphs on a CPU).
    lora_rows = results["lora"]["rows"]
    assert [r["workload"] for r in lora_rows[:4]] == ["c=1, base", "c=1, adapter", "c=8, base", "c=8, 4 adapters"]
    assert len(lora_rows) == 8 and all(r["itl_p50_ms"] > 0 and r["tok_s"] > 0 for r in lora_rows)
    names = [t["name"] for t in results["targets"]]
    assert "bf16 c=1 decode ITL p50 / floor" in names and "tok/s vs transformers CB, c=4" in names
    wanted = {"FP8 c=1 ITL p50 / its own floor", "AWQ INT4 c=1 ITL p50 / bf16", "voice bot c=256 output tok/s"}
    assert wanted <= set(names)
    # c=1 has a p99 ITL target and no tok/s one.
    assert "voice bot c=1 p99 ITL" in names and "voice bot c=1 output tok/s" not in names
    # Every target says what was measured against which goal, where and when.
    assert results["device"] == "CPU" and results["date"]
    for target in results["targets"]:
        assert set(target) >= {"name", "measured", "goal", "met", "device", "date"}, target
        assert target["device"] == "CPU" and target["date"] == results["date"]
    measured = {t["name"]: t for t in results["targets"]}
    assert measured["bf16 c=1 decode ITL p50 / floor"]["measured"] > 0
    assert measured["GPTQ INT4 c=1 ITL p50 / its own floor"]["measured"] > 0


def _rehearse(out: Path, phases: str, *, timeout_s: float) -> None:
    """``gpu_run.sh --smoke --only PHASES`` into ``out``, on this test's interpreter; it must exit 0."""
    env = {**os.environ, "OUT": str(out), "PY": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # gpu_parity --smoke sets it itself, before triton's import
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_run.sh"), "--smoke", "--only", phases],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_gpu_run_script_rehearses_on_cpu(tmp_path: Path) -> None:
    """The prepared GPU run (benchmarks/gpu_run.sh) in its CPU rehearsal: every phase leaves its files and its
    exit status in summary.json, greedy parity with transformers holds on the CPU's attention paths, and every
    registered architecture passes its own (archparity, its verdicts in summary.json)."""
    _rehearse(tmp_path, "env,parity,moe,archparity", timeout_s=700)
    summary = json.loads((tmp_path / "summary.json").read_text())
    phases = {"env", "parity", "moe", "archparity"}
    assert set(summary) == phases and all(phase["rc"] == 0 for phase in summary.values()), summary
    assert summary["archparity"]["architectures"] == dict.fromkeys(ARCHITECTURE_INFO, "pass"), summary
    with tarfile.open(tmp_path / "gpu_run_files.tar") as tar:
        assert {"./moe_gpu.json", "./arch_parity.json"} <= set(tar.getnames())
    parity = json.loads((tmp_path / "gpu_parity.json").read_text())
    assert parity["failures"] == [] and len(parity["cases"]) >= 4
    assert all(case["all_equal"] for case in parity["cases"]), parity["cases"]
    assert "torch" in (tmp_path / "gpu_run.log").read_text()


def test_arch_parity_builds_every_registered_architecture_and_judges_ties() -> None:
    """Each registry architecture has its tiny checkpoint (one registered without is refused by name), and a case
    passes only without an error and with every differing token on a reference tie."""
    assert all(checkpoint_args(name)["arch"] for name in ARCHITECTURE_INFO)
    with pytest.raises(ValueError, match="XForCausalLM has no tiny checkpoint"):
        checkpoint_args("XForCausalLM")
    row = {"error": None, "tie": 1e-4, "mismatches": [{"ref_gap": 5e-5}]}
    assert passed(row)
    assert not passed(row | {"mismatches": [{"ref_gap": 0.3}]})
    assert not passed(row | {"error": "RuntimeError()"})


@pytest.mark.slow
def test_gpu_run_determinism_phase_rehearses_on_cpu(tmp_path: Path) -> None:
    """The deterministic mode's cost phase on the model phase's checkpoint: mode off and on at c=1 and c=8, in
    determinism_gpu.json inside gpu_run_files.tar."""
    _rehearse(tmp_path, "model,determinism", timeout_s=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["determinism"]["rc"] == 0, summary
    with tarfile.open(tmp_path / "gpu_run_files.tar") as tar:
        member = tar.extractfile("./determinism_gpu.json")
        assert member is not None
        doc = json.loads(member.read())
    assert doc["device"] == "cpu" and [row["c"] for row in doc["cost"]] == [1, 8]
    for row in doc["cost"]:
        assert row["itl_ms_on"] > 0 and row["itl_ms_off"] > 0
        assert row["itl_ratio"] == row["itl_ms_on"] / row["itl_ms_off"]


# The per-step fields of gpu_profile.json (docs/benchmarks.md's H100 section describes them).
STEP_FIELDS = {
    "step",
    "itl_ms",
    "trace_step_ms",
    "tokens",
    "gpu_busy_ms",
    "gpu_idle_ms",
    "host_before_first_launch_ms",
    "first_kernel_start_ms",
    "after_last_kernel_ms",
    "kernels",
    "launches",
    "gaps",
    "top_kernels",
}


@pytest.mark.slow
def test_gpu_run_profile_and_targets_rehearse_on_cpu(tmp_path: Path) -> None:
    """The model, profile and c1 phases in their CPU rehearsal: per-step profile rows, the target list with its
    device and date copied where the repository keeps it, and no more files in $OUT than a lent machine hands back."""
    _rehearse(tmp_path, "model,profile,c1", timeout_s=300)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(summary[p]["rc"] == 0 for p in ("model", "profile", "c1")), summary
    assert summary["targets"]["file"] == "gpu_targets.json" and summary["targets"]["keep_as"] == "docs/gpu_targets.json"

    profile = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert profile["partial"] is False and profile["errors"] == [] and profile["device"] == "CPU" and profile["date"]
    assert [c["format"] for c in profile["configs"]] == ["bf16", "fp8", "awq"]
    for config in profile["configs"]:
        assert config["floor_ms"] > 0 and config["weight_bytes"] > 0
        assert [run["concurrency"] for run in config["runs"]] == [1, 8]
        for run in config["runs"]:
            assert len(run["steps"]) == profile["steps"]
            for row in run["steps"]:
                assert set(row) >= STEP_FIELDS, row
                assert row["tokens"] == run["concurrency"] and row["itl_ms"] > 0 and row["gpu_busy_ms"] == 0.0
                assert row["top_kernels"] and row["top_kernels"][0]["ms"] > 0
            assert run["summary"]["itl_ms"]["p50"] > 0 and run["itl_unprofiled_ms"]["p50"] > 0
            assert run["top_kernels"] and 0 < run["trace"]["bytes"] <= 1.5 * 2**20
    assert "| bf16 | 1 |" in (tmp_path / "gpu_profile.md").read_text()

    targets = json.loads((tmp_path / "gpu_targets.json").read_text())
    assert targets["device"] == "CPU" and targets["groups_run"] == ["c1"]
    for target in targets["targets"]:
        assert set(target) >= {"name", "measured", "goal", "met", "device", "date"} and target["date"]
    c1 = {t["name"]: t for t in targets["targets"]}
    assert c1["bf16 c=1 decode ITL p50 / floor"]["measured"] > 0 and c1["AWQ INT4 c=1 ITL p50 / bf16"]["measured"] > 0
    assert c1["voice bot c=64 p99 ITL"]["measured"] is None and c1["voice bot c=64 p99 ITL"]["met"] is None

    with tarfile.open(tmp_path / "gpu_run_files.tar") as tar:
        traces = {Path(n).name for n in tar.getnames() if n.endswith(".json.gz")}
    assert traces == {f"{f}_c{c}.json.gz" for f in ("bf16", "fp8", "awq") for c in (1, 8)}
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= 8, files


def _x(name: str, cat: str, ts: float, dur: float, corr: int | None = None, **args: object) -> dict[str, object]:
    event: dict[str, object] = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}
    if corr is not None:
        args["correlation"] = corr
    if args:
        event["args"] = args
    return event


def test_profile_analysis_of_a_cuda_shaped_trace() -> None:
    """analyze_trace on a trace shaped as kineto writes one on a GPU: kernels tied to their launch calls by
    correlation id (a graph replay's kernels share its id), work that ends after its step's mark, a sync
    with no device work, a kernel whose launch record is missing, and a GPU-side copy of the step mark."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
        _x(STEP_MARK + "0", "user_annotation", 1000, 100),
        _x(STEP_MARK + "1", "user_annotation", 1100, 150),
        _x(STEP_MARK + "0", "gpu_user_annotation", 1000, 100),
        # step 0: the host prepares inputs for 20 us, copies them, replays a graph, waits for it
        _x("cudaMemcpyAsync", "cuda_runtime", 1020, 3, corr=1),
        _x("cudaGraphLaunch", "cuda_runtime", 1030, 4, corr=2),
        _x("cudaStreamSynchronize", "cuda_runtime", 1040, 45, corr=3),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 1025, 2, corr=1),
        _x("gemm", "kernel", 1035, 15, corr=2, **{"graph id": 1}),
        _x("attention", "kernel", 1052, 18, corr=2, **{"graph id": 1}),
        _x("gemm", "kernel", 1070, 10, corr=2, **{"graph id": 1}),
        # step 1: two eager launches, one of whose kernels runs after the step's mark has closed
        _x("cudaLaunchKernel", "cuda_runtime", 1150, 5, corr=4),
        _x("cudaLaunchKernel", "cuda_runtime", 1160, 5, corr=5),
        _x("lm_head", "kernel", 1170, 10, corr=5),
        _x("argmax", "kernel", 1260, 5, corr=4),
        _x("orphan", "kernel", 1200, 4, corr=99),  # no launch record: placed by its own time
        _x("stray", "kernel", 5000, 1, corr=98),  # in no step at all
        _x("aten::mm", "cpu_op", 1010, 5),
    ]
    result = analyze_trace(events, [0.11, 0.16])
    first, second = result["steps"]
    assert first["itl_ms"] == 0.11 and first["trace_step_ms"] == pytest.approx(0.1)
    assert first["gpu_busy_ms"] == pytest.approx(0.045) and first["gpu_idle_ms"] == pytest.approx(0.055)
    assert first["host_before_first_launch_ms"] == pytest.approx(0.020)  # the sync is no launch
    assert first["first_kernel_start_ms"] == pytest.approx(0.025)
    assert first["after_last_kernel_ms"] == pytest.approx(0.020)
    assert first["kernels"] == 4 and first["launches"] == 2
    assert first["gaps"]["count"] == 2 and first["gaps"]["total_ms"] == pytest.approx(0.010)
    assert first["gaps"]["largest"][0] == {
        "ms": pytest.approx(0.008),
        "after": "Memcpy HtoD (Pinned -> Device)",
        "before": "gemm",
    }
    assert first["top_kernels"][0] == {"name": "gemm", "ms": pytest.approx(0.025), "count": 2}
    assert second["kernels"] == 3 and second["gpu_busy_ms"] == pytest.approx(0.019)
    assert second["host_before_first_launch_ms"] == pytest.approx(0.050)
    assert result["unattributed_device_activities"] == 1 and result["device_activities"] == 8
    assert result["top_kernels"][0]["name"] == "gemm" and "device" in result["top_kernels_source"]
    assert result["summary"]["gpu_busy_ms"]["p50"] == pytest.approx(0.032)

    blob, kept = trimmed_trace({"traceEvents": events}, result["windows"], 10_000)
    assert kept["steps_kept"] == 2 and len(blob) == kept["bytes"] <= 10_000
    # Names that do not compress: the second step's events no longer fit, then not all of the first's.
    rng = random.Random(0)
    noise = [_x(rng.randbytes(24).hex(), "cpu_op", 1000 + i % 250, 1) for i in range(500)]
    _, one = trimmed_trace({"traceEvents": events + noise}, result["windows"], 12_000)
    assert one["bytes"] <= 12_000 and one["steps_kept"] == 1
    _, part = trimmed_trace({"traceEvents": events + noise}, result["windows"], 4_000)
    assert part["bytes"] <= 4_000 and part["steps_kept"] == 0 and part["events_kept"] > 0
