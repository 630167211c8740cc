"""Quality on real weights: SmolLM2-135M-Instruct (the Q4_1 GGUF, dequantized to fp32 at load) on CPU.

1. Greedy equality with transformers ``generate`` (fp32) for chat prompts sharing a system prompt: the torch
   backend all at once, staggered (prefix-cache hits), with chunked prefill and under recompute preemption; the
   Triton backend (``TRITON_INTERPRET=1`` on a CPU: slow, so few tokens).
2. Teacher forcing on ``tests/data/quality_text.txt`` against the exact model: top-1 agreement and perplexity of
   the FP8 KV cache, bitsandbytes int8 / NF4, FP8 weights and bf16, beside transformers' own variant where one runs
   on a CPU; for weight quantizations, the same per layer kind (one kind quantized at a time).
3. N-gram speculative decoding of a summarise-this-passage prompt against plain decoding, same engine, same run.

Usage: ``python -m benchmarks.quality`` (about 10 minutes on 2 shared cores; ``--quick`` for a smoke run). The
measured sections of ``docs/quality.md`` (between its ``quality:begin`` / ``quality:end`` markers) are rewritten;
the text around them is kept. Needs bitsandbytes and accelerate (transformers' bitsandbytes loading) for the peers.
"""

from __future__ import annotations

import os

import torch

# Triton fixes its language helpers at first import: interpreter mode must be chosen before the engine loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

from benchmarks import quality_measures as qm

DOC = qm.REPO / "docs" / "quality.md"
BEGIN, END = "<!-- quality:begin -->", "<!-- quality:end -->"
# The quality targets (see docs/quality.md).
FP8_KV_MIN_AGREEMENT = 0.98
FP8_KV_MAX_PPL_CHANGE = 0.02
ENGINE_FP8_KV = qm.ENGINE_VARIANTS["FP8 KV cache"]


def run_greedy(gguf: Path, ref: qm.Reference, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, setup in qm.GREEDY_SETUPS.items():
        check = qm.check_greedy(gguf, ref, prompts, args.greedy_tokens, f"torch: {name}", **setup)
        rows.append(check.row())
        print(json.dumps(rows[-1]), flush=True)
    check = qm.check_greedy(
        gguf,
        ref,
        prompts[: args.triton_prompts],
        args.triton_tokens,
        "triton (interpreter): prefix caching",
        staggered=True,
        attention_backend="triton",
    )
    rows.append(check.row())
    print(json.dumps(rows[-1]), flush=True)
    return rows


def run_teacher_forcing(gguf: Path, ref: qm.Reference, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    engine: dict[str, dict] = {}
    peers: dict[str, dict] = {}
    for name, kwargs in qm.ENGINE_VARIANTS.items():
        engine[name] = qm.measure_engine(gguf, ref, ids, **kwargs).row()
        print(name, json.dumps(engine[name]), flush=True)
        if name in qm.HF_PEERS:
            peers[name] = qm.measure_hf(ref, qm.HF_PEERS[name], ids).row()
            print(f"  transformers {qm.HF_PEERS[name]}", json.dumps(peers[name]), flush=True)
    per_kind: dict[str, dict[str, dict]] = {}
    for method in args.per_kind:
        per_kind[method] = {k: a.row() for k, a in qm.measure_per_kind(gguf, ref, ids, method).items()}
        print(method, "per kind", json.dumps(per_kind[method]), flush=True)
    diagnostics: dict[str, dict] = {}
    if args.per_kind:
        diagnostics["FP8 weights, activations left fp32 (weight-only)"] = qm.measure_fp8_weight_only(
            gguf, ref, ids
        ).row()
        for name, a in qm.measure_fp8_kv_parts(gguf, ref, ids).items():
            diagnostics[f"FP8 KV rounding emulated: {name}"] = a.row()
        for name, kwargs in (("FP8 KV cache", ENGINE_FP8_KV), ("bf16", {"dtype": "bfloat16"})):
            logits = qm.engine_logits(qm.make_llm(gguf, **kwargs), ids)
            diagnostics[f"{name}: exact model's top-1 margin"] = qm.flip_margins(logits, ref.logits(ids))
        print("diagnostics", json.dumps(diagnostics), flush=True)
    return {"engine": engine, "transformers": peers, "per_kind": per_kind, "diagnostics": diagnostics}


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """The measured sections of docs/quality.md, as markdown."""
    meta = results["meta"]
    out = [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Date: {meta['date']}; wall time {meta['wall_s']} s",
        "",
        "### Greedy equality with transformers (fp32)",
        "",
        _table(
            ["engine setup", "prompts", "tokens each", "equal to transformers", "prefix-hit tokens", "preemptions"],
            [
                [
                    r["name"],
                    r["prompts"],
                    r["tokens_each"],
                    f"{r['equal']}/{r['prompts']}",
                    r["prefix_hit_tokens"],
                    r["preemptions"],
                ]
                for r in results["greedy"]
            ],
        ),
        "",
        f"### Teacher-forced agreement with the exact model ({results['text_tokens']} tokens, positions "
        f"{qm.PREFILL_LEN}..{results['text_tokens'] - 2} measured)",
        "",
    ]
    tf = results["teacher_forcing"]
    rows = []
    for name, row in tf["engine"].items():
        peer = tf["transformers"].get(name)
        peer_cells = [peer["top1_agreement"], f"{peer['perplexity_change_pct']:+.2f}%"] if peer else ["-", "-"]
        rows.append(
            [name, row["top1_agreement"], row["perplexity"], f"{row['perplexity_change_pct']:+.2f}%", *peer_cells]
        )
    ref_ppl = next(iter(tf["engine"].values()))["reference_perplexity"]
    out.append(
        _table(
            [
                "variant",
                "engine top-1 agreement",
                "engine perplexity",
                "perplexity change",
                "transformers top-1 agreement",
                "transformers perplexity change",
            ],
            rows,
        )
    )
    out += ["", f"Exact model (transformers fp32) perplexity on the same positions: {ref_ppl}."]
    for method, kinds in tf["per_kind"].items():
        out += ["", f"Per layer kind, `{method}` on that kind only (all 30 layers), the rest fp32:", ""]
        out.append(
            _table(
                ["quantized kind", "top-1 agreement", "perplexity change"],
                [[k, r["top1_agreement"], f"{r['perplexity_change_pct']:+.2f}%"] for k, r in kinds.items()],
            )
        )
    diag = tf.get("diagnostics", {})
    if diag:
        out += ["", "Diagnostics (each against the exact model):", ""]
        out += [f"- {name}: `{json.dumps(row)}`" for name, row in diag.items()]
    spec = results["speculation"]
    out += [
        "",
        "### N-gram speculative decoding (summarise-this-passage prompt)",
        "",
        _table(
            [
                "prompt tokens",
                "output tokens",
                "plain tok/s",
                "ngram tok/s",
                "speed-up",
                "acceptance rate",
                "mean accepted length",
            ],
            [
                [
                    spec["prompt_tokens"],
                    spec["output_tokens"],
                    spec["plain_tok_s"],
                    spec["spec_tok_s"],
                    f"{spec['speedup']}x",
                    spec["acceptance_rate"],
                    spec["mean_accepted_length"],
                ]
            ],
        ),
        "",
        f"Reply (greedy, stops at EOS): {spec['reply']!r}",
    ]
    return "\n".join(out)


def write_doc(section: str, doc: Path = DOC) -> None:
    """Replace the text between the markers of ``doc`` (created with just the markers if missing)."""
    text = doc.read_text() if doc.exists() else f"# Quality on real weights\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{section}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens, no per-kind runs, no doc update")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--greedy-tokens", type=int, default=24)
    parser.add_argument("--triton-prompts", type=int, default=2)
    parser.add_argument("--triton-tokens", type=int, default=3)
    parser.add_argument("--spec-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--per-kind", nargs="*", default=["bnb-int8", "bnb-nf4", "fp8"])
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    if args.quick:
        args.greedy_tokens, args.triton_prompts, args.triton_tokens = 8, 1, 2
        args.spec_tokens, args.repeats, args.per_kind = 32, 1, []
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    gguf = qm.model_path()
    qm.make_llm(gguf, dtype="float32", num_kv_blocks=1 + 1024 // 16)  # converts the GGUF once if needed
    ref = qm.Reference(qm.hf_folder(gguf))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ref.folder))
    prompts = [qm.chat_ids(tokenizer, q) for q in qm.CHAT_QUESTIONS]
    ids = qm.text_ids(tokenizer, 200 if args.quick else None)
    results: dict[str, Any] = {"text_tokens": len(ids)}
    results["greedy"] = run_greedy(gguf, ref, prompts, args)
    results["teacher_forcing"] = run_teacher_forcing(gguf, ref, ids, args)
    results["speculation"] = qm.measure_speculation(gguf, args.spec_tokens, args.repeats)
    print("speculation", json.dumps(results["speculation"]), flush=True)
    results["meta"] = {
        "command": "python -m benchmarks.quality" + (" --quick" if args.quick else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs), torch "
        f"{torch.__version__}, {args.threads} thread(s), CPU only",
        "date": datetime.date.today().isoformat(),
        "wall_s": round(time.perf_counter() - start),
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not args.quick:
        write_doc(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
