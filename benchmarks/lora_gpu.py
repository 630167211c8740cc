"""Adapters through the whole engine on the GPU run's 8B shape: decode ITL and tok/s with LoRA requests against base
requests, with the decode CUDA graphs' LoRA variants and eagerly (``enforce_eager``), in one phase of
``benchmarks/engine_gpu.py`` (``--skip lora`` leaves it out).

The adapters are written here as PEFT files (``adapter_config.json`` + ``adapter_model.safetensors``, the format
``gpu_workers.engine.lora.peft_files`` reads), rank 16 on q_proj and v_proj (PEFT's default targets for a Llama), with
small random A and B: loading the 16 GB base model into ``peft`` to make them would cost more than the phase.
Each engine runs, in turn: one request at a time with and without an adapter (ITL p50), then 8 requests at once,
all base or spread over 4 adapters (tok/s, ITL p50).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from gpu_workers.engine import LoRARequest
from gpu_workers.engine.lora.peft_files import module_dims

RANK = 16
TARGETS = ("q_proj", "v_proj")
ADAPTERS = 4
BATCH = 8


def write_adapter(base: Path, out: Path, seed: int, rank: int = RANK) -> Path:
    """A PEFT LoRA adapter for the checkpoint in ``base``: rank ``rank`` on ``TARGETS``, normal(0, 0.01) A and B."""
    config = AutoConfig.from_pretrained(str(base))
    dims = module_dims(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config.num_hidden_layers)):
        for module in TARGETS:
            in_f, out_f = dims[module]
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.01).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none", "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    return out


def lora_phase(
    setup: Any, path: Path, make_engine: Callable[..., Any], burst: Callable[..., Any], log: Callable[[str], None]
) -> dict[str, Any]:
    """Rows of (engine mode, workload) -> ITL p50 and tok/s; ``make_engine``/``burst``/``log`` are engine_gpu's."""
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(path, path.parent / f"{path.name}-loras" / f"a{i}", seed=i)))
        for i in range(ADAPTERS)
    ]
    rng = torch.Generator().manual_seed(5)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(3, setup.vocab, (32,), generator=rng).tolist() for _ in range(n)]

    rows: list[dict[str, Any]] = []
    for eager in (False, True):
        engine = make_engine(setup, path, max_num_seqs=BATCH, enable_lora=True, max_loras=ADAPTERS,
                             enforce_eager=eager)  # fmt: skip
        graphs = engine.runner.decode_graphs is not None
        mode = "CUDA graphs" if graphs else "eager" if eager else "eager (no CUDA graphs here)"
        try:
            for lora in adapters:
                engine.add_lora(lora)
            burst(engine, prompts(1), 8, loras=[adapters[0]])  # warm-up: loads a slot, compiles the kernels
            workloads = (
                ("c=1, base", [None]),
                ("c=1, adapter", [adapters[0]]),
                (f"c={BATCH}, base", [None] * BATCH),
                (f"c={BATCH}, {ADAPTERS} adapters", [adapters[i % ADAPTERS] for i in range(BATCH)]),
            )
            for name, loras in workloads:
                stats = burst(engine, prompts(len(loras)), setup.output_len, loras=loras).summary()
                row = {"mode": mode, "workload": name, "itl_p50_ms": stats["itl_p50_ms"],
                       "tok_s": stats["output_tok_s"]}  # fmt: skip
                rows.append(row)
                log(f"lora {mode} {name}: ITL p50 {row['itl_p50_ms']:.2f} ms, {row['tok_s']:.0f} tok/s")
        finally:
            del engine
    return {"rank": RANK, "targets": list(TARGETS), "adapters": ADAPTERS, "rows": rows}


def report(result: dict[str, Any]) -> str:
    """The phase's markdown table: every row, with its ITL against the same engine's base row of that concurrency."""
    rows = result["rows"]
    base = {(r["mode"], r["workload"].split(",")[0]): r["itl_p50_ms"] for r in rows if "base" in r["workload"]}
    lines = [
        f"Multi-LoRA (rank {result['rank']} on {'/'.join(result['targets'])}, {result['adapters']} adapters loaded):",
        "",
        "| engine | workload | ITL p50 ms | out tok/s | ITL / same engine's base |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["itl_p50_ms"] / base[(r["mode"], r["workload"].split(",")[0])]
        lines.append(f"| {r['mode']} | {r['workload']} | {r['itl_p50_ms']:.2f} | {r['tok_s']:.0f} | {ratio:.2f}x |")
    return "\n".join(lines)
