"""The GPU benchmark script runs end to end in its CPU smoke mode (tiny model, same code path), so
it cannot rot between GPU runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_gpu_run_script_rehearses_on_cpu(tmp_path: Path) -> None:
    """The prepared GPU run (benchmarks/gpu_run.sh) in its CPU rehearsal: every phase leaves its files and its
    exit status in summary.json, and greedy parity with transformers holds on the CPU's attention paths."""
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # gpu_parity --smoke sets it itself, before triton's import
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_run.sh"), "--smoke", "--only", "env,parity"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"env", "parity"} and all(phase["rc"] == 0 for phase in summary.values()), summary
    parity = json.loads((tmp_path / "gpu_parity.json").read_text())
    assert parity["failures"] == [] and len(parity["cases"]) >= 4
    assert all(case["all_equal"] for case in parity["cases"]), parity["cases"]
    assert "torch" in (tmp_path / "gpu_run.log").read_text()
