"""benchmarks/engine_step.py runs end to end on a tiny random model (its figures come from the real model;
this catches a broken phase wrapper or report before a benchmark run does)."""

from __future__ import annotations

import json
from pathlib import Path

from needs import needs

from benchmarks import engine_step
from gpu_workers.engine.execution.cpu_decode_compile import cxx_compiler
from gpu_workers.engine.models.random_checkpoint import make_tiny_model


def test_engine_step_breaks_a_decode_step_down(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", num_layers=2, hidden_size=64, vocab_size=512)
    out = tmp_path / "step.json"
    argv = ["--model", str(model), "--batch", "1", "3", "--steps", "3", "--rounds", "1", "--dtype", "float32"]
    assert engine_step.main([*argv, "--profile-dir", str(tmp_path / "profiles"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["floor_ms"] > 0 and result["weight_bytes_per_step"] > 0
    assert result["device"] == "cpu" and "host thread" in result["host_ms_method"]
    for batch in ("1", "3"):
        row = result["batches"][batch]
        assert row["step_ms"] > 0 and abs(row["tok_s"] - int(batch) * 1e3 / row["step_ms"]) < 1e-6
        # On the CPU the device is the host: the whole step is host time.
        assert row["device_busy_ms"] == 0.0 and row["host_ms"] == row["step_ms"]
        assert {"scheduling", "model forward", "sampling", "bookkeeping (rest of step)"} <= set(row["phases_ms"])
        kinds = row["forward_by_kind_ms_hooked"]
        assert kinds["qkv_proj"] > 0 and kinds["attention + KV write"] > 0 and kinds["norm"] > 0
    isa = result["isa"]
    assert isinstance(isa, str) and isa  # torch's dispatch capability, named in the profile's file
    profile = tmp_path / "profiles" / f"engine_step_float32_{isa.lower()}_t2_b3.txt"
    assert profile.read_text().count("aten::") > 3
    # The engine is left as it was: no wrapper stays behind.


@needs(cxx_compiler() is not None, "a C++ compiler for Inductor", "apt-get install g++")
def test_engine_step_times_compiled_decode_steps(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", num_layers=2, hidden_size=64, vocab_size=512)
    out = tmp_path / "step.json"
    argv = ["--model", str(model), "--batch", "1", "3", "--steps", "3", "--rounds", "1", "--dtype", "float32"]
    argv += ["--compile-cpu-decode", "--kv-blocks", "300", "--profile-dir", "", "--out", str(out)]
    assert engine_step.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["compiled_decode"] is True and result["kv_blocks"] == 300
    assert all(result["batches"][b]["step_ms"] > 0 for b in ("1", "3"))
