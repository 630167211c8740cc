"""FP8 KV cache (``kv_cache_dtype="fp8"``) against the model-dtype cache, in one run: how many
sequences a fixed KV budget holds at once, and decode inter-token latency.

* capacity: for each cache dtype an engine gets the same KV budget in bytes (turned into a block
  count with that dtype's element size, as the engine's own sizing does) and far more seats
  (``max_num_seqs``) than fit. ``requests`` requests (``prompt_len`` prompt tokens, ``output_len``
  output tokens, EOS ignored; fields of :class:`Workload`) are submitted at once; the figure is the
  peak number of sequences running together over the run (``EngineStats.num_running`` after each
  step), with preemptions.
* ITL: for each cache dtype an engine holds the same ``itl_batch`` sequences (``itl_context``
  tokens of prompt) and decodes ``itl_steps`` tokens; each step's wall time is one inter-token
  latency for every sequence. The two engines step in lockstep (alternating which goes first) for
  ``rounds`` rounds of fresh prompts, so a load spike on a shared box lands on both; the ratio is
  the median of the paired step-time ratios.

Usage (CPU, the figures in docs/benchmarks.md): ``PYTHONPATH=. python3 benchmarks/kv_cache_fp8.py``;
``--quick`` for a smaller run. ``benchmarks/engine_gpu.py`` calls :func:`compare` on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_workers.engine import EngineConfig, LLMEngine, SamplingParams
from gpu_workers.engine.attention.kv_quant import parse_kv_cache_dtype
from gpu_workers.engine.config import parse_dtype

CACHE_DTYPES = ("auto", "fp8")


@dataclass
class Workload:
    """What the comparison runs; defaults are the recorded CPU run."""

    kv_budget_bytes: int = 16 << 20
    requests: int = 64
    prompt_len: int = 96
    output_len: int = 32
    itl_batch: int = 16
    itl_context: int = 512
    itl_steps: int = 16
    rounds: int = 3


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def blocks_for_budget(path: Path, engine_args: dict[str, Any], kv_cache_dtype: str, budget_bytes: int) -> int:
    """KV blocks of ``budget_bytes`` for this model and cache dtype (2 x layers x block x KV heads x
    head dim x element size per block, as ``model_runner.kv_bytes_per_block``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = torch.device(engine_args.get("device", "cpu"))
    model_dtype = parse_dtype(engine_args.get("dtype", "auto")) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    element = (parse_kv_cache_dtype(kv_cache_dtype) or model_dtype).itemsize
    per_block = 2 * config.num_hidden_layers * engine_args.get("block_size", 16) * kv_heads * head_dim * element
    return budget_bytes // per_block


def _engine(path: Path, engine_args: dict[str, Any], kv_cache_dtype: str, **overrides: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(path), kv_cache_dtype=kv_cache_dtype, seed=0, **{**engine_args, **overrides})
    )


def capacity(path: Path, engine_args: dict[str, Any], kv_cache_dtype: str, work: Workload) -> dict[str, Any]:
    """Peak concurrent sequences under the fixed KV budget (see the module docstring)."""
    blocks = blocks_for_budget(path, engine_args, kv_cache_dtype, work.kv_budget_bytes)
    engine = _engine(path, engine_args, kv_cache_dtype, num_kv_blocks=blocks, max_num_seqs=work.requests,
                     max_model_len=work.prompt_len + work.output_len)  # fmt: skip
    for prompt in _prompts(work.requests, work.prompt_len, engine.vocab_size, seed=1):
        engine.add_request(prompt, _greedy(work.output_len))
    peak, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        peak = max(peak, engine.stats().num_running)
    stats = engine.stats()
    wall = time.perf_counter() - start
    cache_bytes = engine.runner.kv_cache.nbytes if engine.runner.kv_cache is not None else 0
    _release(engine)
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "kv_blocks": blocks,
        "kv_cache_bytes": cache_bytes,
        "peak_running": peak,
        "preemptions": stats.num_preemptions,
        "steps": steps,
        "wall_s": wall,
        "tokens_per_s": work.requests * work.output_len / wall,
    }


def _release(*engines: LLMEngine) -> None:
    """Drop the engines' weights and caches now (a GPU holds one or two copies of a large model)."""
    for engine in engines:
        engine.runner.decode_graphs = None
        engine.runner.kv_cache = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decoding(engine: LLMEngine, batch: int) -> bool:
    """True when the next step is a pure decode step of all ``batch`` sequences."""
    running = engine.scheduler.running
    full = len(running) == batch and not engine.scheduler.waiting
    return full and all(seq.num_computed_tokens + 1 == seq.num_tokens for seq in running)


def _timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def itl(path: Path, engine_args: dict[str, Any], work: Workload) -> dict[str, dict[str, float]]:
    """Decode step times per cache dtype. Both engines hold the same prompts and step in lockstep,
    alternating which goes first, so each pair of steps sees the same load on a shared machine."""
    context = work.itl_context + work.itl_steps + 1
    blocks = work.itl_batch * -(-context // engine_args.get("block_size", 16)) + 1
    sizes = dict(num_kv_blocks=blocks, max_num_seqs=work.itl_batch, max_model_len=context)
    engines = {d: _engine(path, engine_args, d, **sizes) for d in CACHE_DTYPES}
    steps: dict[str, list[float]] = {d: [] for d in CACHE_DTYPES}
    ratios: list[float] = []
    for r in range(work.rounds + 1):  # round 0 warms up (allocator, thread pools) and is not kept
        # Fresh prompts each round (prefix caching would otherwise skip the prefill).
        for prompt in _prompts(work.itl_batch, work.itl_context, engines["auto"].vocab_size, seed=100 + r):
            for engine in engines.values():
                engine.add_request(prompt, _greedy(work.itl_steps + 1))
        flip = False
        while any(e.has_unfinished() for e in engines.values()):
            timed = {d: _decoding(e, work.itl_batch) for d, e in engines.items()}
            order = list(reversed(CACHE_DTYPES)) if flip else list(CACHE_DTYPES)
            took = {d: _timed_step(engines[d]) for d in order if engines[d].has_unfinished()}
            flip = not flip
            if r > 0 and all(timed.values()) and len(took) == len(CACHE_DTYPES):
                for d in CACHE_DTYPES:
                    steps[d].append(took[d])
                ratios.append(took["fp8"] / took["auto"])
    result: dict[str, dict[str, float]] = {
        d: {
            "itl_p50_ms": 1e3 * statistics.median(t),
            "itl_p90_ms": 1e3 * statistics.quantiles(t, n=10)[-1],
            "steps": len(t),
        }
        for d, t in steps.items()
    }
    result["paired"] = {"fp8_over_auto_p50": statistics.median(ratios), "pairs": len(ratios)}
    _release(*engines.values())
    return result


def compare(path: Path, engine_args: dict[str, Any], work: Workload) -> dict[str, Any]:
    """Both comparisons; ratios are fp8 over auto from this run."""
    cap = {d: capacity(path, engine_args, d, work) for d in CACHE_DTYPES}
    lat = itl(path, engine_args, work)
    return {
        "workload": work.__dict__,
        "capacity": cap,
        "itl": lat,
        "capacity_ratio": cap["fp8"]["peak_running"] / max(1, cap["auto"]["peak_running"]),
        "itl_ratio": lat["paired"]["fp8_over_auto_p50"],
    }


def report(result: dict[str, Any], title: str) -> str:
    work = result["workload"]
    lines = [
        f"### {title}",
        "",
        f"KV budget {work['kv_budget_bytes'] / (1 << 20):g} MiB; capacity: {work['requests']} requests x "
        f"({work['prompt_len']} prompt + {work['output_len']} output) tokens submitted at once. ITL: "
        f"{work['itl_batch']} sequences x {work['itl_context']}-token prompts, {work['itl_steps']} decode steps x "
        f"{work['rounds']} interleaved rounds.",
        "",
        "| kv_cache_dtype | KV blocks | peak running seqs | preemptions | tok/s at capacity | ITL p50 ms | p90 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype in CACHE_DTYPES:
        cap, lat = result["capacity"][dtype], result["itl"][dtype]
        lines.append(
            f"| {dtype} | {cap['kv_blocks']} | {cap['peak_running']} | {cap['preemptions']} | "
            f"{cap['tokens_per_s']:.0f} | {lat['itl_p50_ms']:.2f} | {lat['itl_p90_ms']:.2f} |"
        )
    lines += [
        "",
        f"fp8 / auto: concurrent sequences **{result['capacity_ratio']:.2f}x** (target 2x against a 16-bit cache), "
        f"decode ITL **{result['itl_ratio']:.2f}x** (median of {result['itl']['paired']['pairs']} paired steps).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller run (seconds)")
    parser.add_argument("--dtype", default="bfloat16", help="model dtype; bfloat16 makes auto a 16-bit cache")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    work = Workload() if not args.quick else Workload(4 << 20, 16, 48, 16, 4, 128, 4, 2)
    engine_args = {"device": "cpu", "dtype": args.dtype, "attention_backend": "torch", "max_num_batched_tokens": 4096}
    with tempfile.TemporaryDirectory() as tmp:
        # The KV geometry of engine_cpu.py's model (8 layers, 4 KV heads of dim 64: 8 KiB a token in
        # bf16) on a narrower body (hidden 256, 4 query heads, vocab 4096), so bf16 runs in minutes.
        path = make_tiny_model(Path(tmp) / "model", arch="llama", num_layers=8, hidden_size=256, num_heads=4,
                               num_kv_heads=4, vocab_size=4096, init_std=0.02)  # fmt: skip
        result = compare(path, engine_args, work)
    result["model_dtype"] = args.dtype
    print(report(result, f"FP8 KV cache on CPU (model {args.dtype}, torch backend, {args.threads} thread)"))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
