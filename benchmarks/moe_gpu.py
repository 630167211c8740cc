"""Mixture-of-experts decode on one GPU: a Mixtral-shaped random checkpoint (hidden 4096, 8 experts of
intermediate 14336, top-2, 32 query / 8 KV heads, vocabulary 32000) cut to ``--layers`` layers (8 by default:
23.7 GB in bfloat16, which fits one H100 beside its KV cache; Mixtral-8x7B's 32 need two), served by the engine
(the Triton grouped-GEMM experts, CUDA graphs).

It measures decode ITL at concurrency 1 and output tok/s at concurrency 64 (128-token prompts, 128 new tokens),
and sets each against its floor: the bytes a decode step must read (every layer's attention weights, the routed
experts' weights - the top-2 at c=1, every expert hit at c=64 - and the LM head) over the measured device-to-device
copy bandwidth. Writes ``--out`` (JSON) and prints a table. ``--smoke`` runs the same code on the CPU, tiny.

    python -m benchmarks.moe_gpu [--layers 8] [--out moe_gpu.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import MixtralConfig

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.random_checkpoint import build_tokenizer

FULL = dict(hidden=4096, inter=14336, experts=8, top_k=2, heads=32, kv_heads=8, vocab=32000)
TINY = dict(hidden=64, inter=96, experts=8, top_k=2, heads=4, kv_heads=2, vocab=512)
PROMPT, NEW = 128, 128


def build(path: Path, shape: dict[str, int], layers: int, device: str, dtype: torch.dtype) -> None:
    """Config, tokenizer and random weights (experts in transformers' fused layout) as a Hugging Face folder."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape["vocab"])
    h, inter, e, kv = (
        shape["hidden"],
        shape["inter"],
        shape["experts"],
        shape["kv_heads"] * shape["hidden"] // shape["heads"],
    )
    config = MixtralConfig(
        vocab_size=shape["vocab"], hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], num_local_experts=e,
        num_experts_per_tok=shape["top_k"], max_position_embeddings=4096, sliding_window=None,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device, dtype=dtype).mul_(0.02).cpu()

    save_file({"model.embed_tokens.weight": rand(shape["vocab"], h), "lm_head.weight": rand(shape["vocab"], h),
               "model.norm.weight": torch.ones(h, dtype=dtype)}, str(path / "model-base.safetensors"))  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate.weight": rand(e, h), p + "mlp.experts.gate_up_proj": rand(e, 2 * inter, h),
            p + "mlp.experts.down_proj": rand(e, h, inter),
        }  # fmt: skip
        save_file(tensors, str(path / f"model-layer{i:03d}.safetensors"))


def floor_bytes(shape: dict[str, int], layers: int, experts_read: int, elem: int) -> int:
    """Weight bytes one decode step reads: attention and ``experts_read`` experts per layer, and the LM head."""
    h, inter = shape["hidden"], shape["inter"]
    kv = shape["kv_heads"] * h // shape["heads"]
    attention = h * (h + 2 * kv) + h * h
    return elem * (layers * (attention + experts_read * 3 * h * inter + shape["experts"] * h) + shape["vocab"] * h)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth, bytes read plus written per second (best of 10)."""
    src = torch.empty(1 << 28 if device == "cuda" else 1 << 22, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize() if device == "cuda" else None
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize() if device == "cuda" else None
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def timed(llm: LLM, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/sluicegate-moe-model"))
    parser.add_argument("--out", type=Path, default=Path("moe_gpu.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    shape, layers = (TINY, 2) if args.smoke else (FULL, args.layers)
    prompt, new = (16, 8) if args.smoke else (PROMPT, NEW)
    start = time.perf_counter()
    build(args.model_dir, shape, layers, device, dtype)
    built_s = time.perf_counter() - start
    llm = LLM(str(args.model_dir), device=device, dtype=str(dtype).removeprefix("torch."), max_model_len=1024)
    bandwidth = copy_bandwidth(device)
    elem = torch.empty((), dtype=dtype).element_size()
    results: dict[str, Any] = {"layers": layers, "shape": shape, "device": torch.cuda.get_device_name() if device ==
                               "cuda" else "cpu", "build_s": built_s, "bandwidth_gb_s": bandwidth / 1e9}  # fmt: skip
    rows = []
    for concurrency, experts_read in ((1, shape["top_k"]), (64, shape["experts"])):
        prompts = [[(7 * i + j) % (shape["vocab"] - 3) + 3 for j in range(prompt)] for i in range(concurrency)]
        timed(llm, prompts[:1], 2)  # warm-up (CUDA graphs captured at start, kernels compiled here)
        first = timed(llm, prompts, 1)
        whole = timed(llm, prompts, new)
        itl_ms = 1e3 * (whole - first) / (new - 1)
        floor_ms = 1e3 * floor_bytes(shape, layers, experts_read, elem) / bandwidth
        rows.append({"concurrency": concurrency, "itl_ms": itl_ms, "tok_s": concurrency * new / whole,
                     "floor_ms": floor_ms, "itl_over_floor": itl_ms / floor_ms})  # fmt: skip
    results["rows"] = rows
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{results['device']}, {layers} Mixtral-shaped layers, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| concurrency | ITL ms | tok/s | floor ms | ITL / floor |\n| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['concurrency']} | {r['itl_ms']:.2f} | {r['tok_s']:.0f} | {r['floor_ms']:.2f} | "
              f"{r['itl_over_floor']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
