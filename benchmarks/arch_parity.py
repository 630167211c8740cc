"""Greedy tokens of the engine against transformers for every architecture in the registry, on one device.

``gpu_parity.py`` checks every attention path on a few dense models; this checks every architecture the engine
registers (``gpu_workers/engine/models/architectures.py``: Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE,
Gemma 3 text-only and vision-language) on its own tiny random checkpoint, in float32 and bfloat16 (transformers in
the same dtype as the reference), on the torch and the Triton attention backends, over ``gpu_parity.py``'s five short
prompts (8 tokens each: the attention paths at length are its job). A token that differs where the
reference's top two logits (nearly) tie is rounding, as in ``gpu_parity.py`` (same ties per dtype); anything else,
or an error, fails the architecture.

Writes every case to ``--out`` (JSON, after each case, so a run cut short keeps what it measured) and, with
``--summary``, each architecture's verdict (``pass`` / ``fail``) under ``archparity.architectures`` of the GPU run's
summary.json. Exit status 1 when an architecture fails.

Usage: ``PYTHONPATH=. python3 -m benchmarks.arch_parity --out arch_parity.json`` on a GPU; ``--smoke`` runs on the
CPU, float32 only, the torch backend for every architecture and the interpreted Triton one for the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    # Triton reads this at its first import: the kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_parity import Case, CaseResult, Reference, make_prompts, run_guarded
from gpu_workers.engine.models import ARCHITECTURE_INFO
from gpu_workers.engine.models.random_checkpoint import ARCHS, make_tiny_model

# Per registered architecture, its tiny checkpoint's arguments beyond ``make_tiny_model``'s arch (the one whose
# name it writes): sliding windows where the architecture has them, Qwen3's and Gemma's own head size, Qwen3-MoE's
# dense layer.
EXTRA: dict[str, dict[str, Any]] = {
    "MistralForCausalLM": dict(sliding_window=48),
    "Qwen3ForCausalLM": dict(head_dim=32),
    "Qwen3MoeForCausalLM": dict(num_layers=3, head_dim=32, config_overrides=dict(mlp_only_layers=[1])),
    "Gemma3ForCausalLM": dict(num_layers=3, head_dim=32, sliding_window=48),
    "Gemma3ForConditionalGeneration": dict(head_dim=32, sliding_window=24),
}
DTYPES = ("float32", "bfloat16")
BACKENDS = ("torch", "triton")


def checkpoint_args(architecture: str) -> dict[str, Any]:
    """``make_tiny_model``'s arguments for a registered architecture; an architecture it cannot write is refused."""
    arch = next((a for a, (_, name) in ARCHS.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"{architecture} has no tiny checkpoint in random_checkpoint.ARCHS")
    return dict(arch=arch, seed=11) | EXTRA.get(architecture, {})


def cases(smoke: bool, first: bool) -> list[Case]:
    """The engine configurations run for one architecture (``first``: the first architecture of the run)."""
    if smoke:
        return [Case("torch float32", "torch")] + ([Case("triton float32", "triton")] if first else [])
    return [Case(f"{backend} {dtype}", backend, dtype=dtype) for dtype in DTYPES for backend in BACKENDS]


def passed(row: dict[str, Any]) -> bool:
    """A case passes without an error and with every differing token on a reference tie."""
    return row["error"] is None and all(m["ref_gap"] <= row["tie"] for m in row["mismatches"])


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def record_summary(summary: Path, verdicts: dict[str, str]) -> None:
    """Each architecture's verdict under ``archparity.architectures`` of the run's summary.json (gpu_run.sh adds
    the phase's exit status and seconds beside it)."""
    data = json.loads(summary.read_text()) if summary.is_file() else {}
    data.setdefault("archparity", {})["architectures"] = verdicts
    write_json(summary, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, float32: torch for all, interpreted Triton once")
    parser.add_argument("--out", type=Path, required=True, help="every case's result (JSON)")
    parser.add_argument("--summary", type=Path, help="the GPU run's summary.json: per-architecture verdicts")
    parser.add_argument("--only", help="comma-separated architectures (default: every registered one)")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; use --smoke on a CPU")
    architectures = args.only.split(",") if args.only else list(ARCHITECTURE_INFO)
    unknown = sorted(set(architectures) - set(ARCHITECTURE_INFO))
    if unknown:
        parser.error(f"unknown architectures {unknown}; registered: {', '.join(ARCHITECTURE_INFO)}")
    # Exact fp32 on both sides: TF32 would round each product to 10 mantissa bits.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU", "cases": []}
    verdicts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, architecture in enumerate(architectures):
            rows = []
            try:
                path = make_tiny_model(Path(tmp) / architecture, **checkpoint_args(architecture))
            except Exception as exc:  # an architecture without a checkpoint fails alone
                traceback.print_exc()
                path, rows = None, [CaseResult("checkpoint", architecture, error=repr(exc)[:2000]).row()]
            prompts = make_prompts(512, smoke=True)  # five short prompts: the attention paths are gpu_parity's
            refs: dict[str, Reference] = {}
            for case in cases(args.smoke, index == 0) if path is not None else []:
                row = run_guarded(case, architecture, path, device, prompts, refs)
                rows.append(row)
                print(f"{architecture:<32} {case.name:<16} {row['equal']}/{row['prompts']} "
                      f"{'PASS' if passed(row) else 'FAIL'}{' ' + row['error'] if row['error'] else ''}",
                      flush=True)  # fmt: skip
                results["cases"].append(row)
                write_json(args.out, results)
            del refs
            verdicts[architecture] = "pass" if rows and all(passed(r) for r in rows) else "fail"
            results["architectures"] = verdicts
            write_json(args.out, results)
            if args.summary is not None:
                record_summary(args.summary, verdicts)
    return 0 if all(v == "pass" for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
