"""Where one decode step of the engine goes, on the real default model on this CPU.

    python -m benchmarks.engine_step [--batch 1 8 32] [--dtype bfloat16] [--quantization Q] [--steps 32]

For each batch size: ``batch`` copies of a chat prompt are prefilled, then ``--steps`` pure decode steps
are timed twice:

1. **clean**: only the step's coarse phases are wrapped (scheduling, input and attention metadata
   preparation, model forward, logits, sampling; the rest of ``LLMEngine.step`` is bookkeeping: token
   appends, block hashing, stop checks, deltas). The step total of this pass is the figure.
2. **by layer kind**: forward hooks time the decoder's modules (norms, each projection, attention with its
   KV write, rotary and activation as the remainders of their blocks). Hooks add their own cost, so this
   pass gives shares of the forward, not its time.

The floor is the bytes of weights one step reads (every parameter but an untied embedding table, which a
step only indexes) over the memory read bandwidth measured here (a sum over a tensor far larger than the
caches, on the same threads). A torch profiler table of each configuration goes to ``--profile-dir``
(docs/profiles/ by default).

**Host ms per step** is the step minus the device's busy time in it: what the host adds to the critical path,
the figure that work taking the host off that path (scheduling ahead, fewer launches, graphs for more steps)
must bring down. On CUDA the busy time is the union of the step's kernel intervals from a torch-profiler pass
(``benchmarks/gpu_profile.py``'s analysis); on the CPU the forward's kernels run on the host thread, so the
device's busy time is 0 and the host ms is the whole step. With a tiny model (``--tiny``: 2 layers, hidden 64,
the shape of ``engine_gpu.py --smoke``) the forward's arithmetic is a small part of that, so the CPU figure is
nearly all engine and framework overhead, comparable before and after such a change without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Tell me about the longest rivers in the world and why they matter."


def read_bandwidth(threads: int, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second that ``sum`` streams out of memory on ``threads`` threads (best of ``repeats``)."""
    torch.set_num_threads(threads)
    big = torch.ones(megabytes * 2**20 // 4)
    big.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers a decode step reads: all of them but an untied embedding table, plus weights
    packed outside tensors (``packed_bytes``: the W8A8 LM head)."""
    embed = model.model.embed_tokens.weight
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or tensor.dim() == 0:
            continue
        seen.add(id(tensor))
        if tensor is embed and head is not embed:
            continue  # only indexed: a few rows per step
        total += tensor.numel() * tensor.element_size()
    total += sum(int(getattr(m, "packed_bytes", 0)) for m in model.modules())
    rope = model.model.rotary_emb
    return total - sum(t.numel() * t.element_size() for t in (rope.cos_cache, rope.sin_cache))


class Timer:
    """Accumulated seconds per phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


class _TimedSampler:
    """The engine calls its sampler as ``self.sampler(...)``: a dunder, so it is wrapped by delegation."""

    def __init__(self, sampler: Any, timer: Timer) -> None:
        self._sampler, self._timed = sampler, timer.wrap("sampling", sampler.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


@contextmanager
def coarse_phases(engine: Any, timer: Timer) -> Iterator[None]:
    runner, model = engine.runner, engine.runner.model
    saved = (engine.scheduler.schedule, runner.prepare, model.forward, model.compute_logits, engine.sampler)
    engine.scheduler.schedule = timer.wrap("scheduling", saved[0])
    runner.prepare = timer.wrap("inputs + attention metadata", saved[1])
    model.forward = timer.wrap("model forward", saved[2])
    model.compute_logits = timer.wrap("logits (lm_head)", saved[3])
    engine.sampler = _TimedSampler(saved[4], timer)
    try:
        yield
    finally:
        del engine.scheduler.schedule, runner.prepare, model.forward, model.compute_logits
        engine.sampler = saved[4]


@contextmanager
def layer_kinds(model: torch.nn.Module, timer: Timer) -> Iterator[None]:
    """Forward hooks on every decoder module; the remainders (rotary, activation) are worked out later."""
    handles = []
    starts: dict[int, float] = {}

    def hook(name: str) -> tuple[Callable[..., None], Callable[..., None]]:
        def pre(module: torch.nn.Module, args: Any) -> None:
            starts[id(module)] = time.perf_counter()

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            timer.seconds[name] += time.perf_counter() - starts.pop(id(module))

        return pre, post

    kinds = {
        "input_layernorm": "norm",
        "post_attention_layernorm": "norm",
        "self_attn": "attention block",
        "self_attn.qkv_proj": "qkv_proj",
        "self_attn.o_proj": "o_proj",
        "mlp": "mlp block",
        "mlp.gate_up_proj": "gate_up_proj",
        "mlp.down_proj": "down_proj",
    }
    for layer in model.model.layers:
        for path, kind in kinds.items():
            module = layer.get_submodule(path)
            pre, post = hook(kind)
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        attn = layer.self_attn
        backend = attn.backend
        # One backend object serves every layer: time its forward once per call.
        if not getattr(backend, "_step_timed", False):
            backend.forward = timer.wrap("attention + KV write", backend.forward)
            backend._step_timed = True
    pre, post = hook("final norm")
    handles += [model.model.norm.register_forward_pre_hook(pre), model.model.norm.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        backend = model.model.layers[0].self_attn.backend
        if getattr(backend, "_step_timed", False):
            del backend.forward
            backend._step_timed = False


def decode_steps(
    llm: Any, prompt: list[int], batch: int, steps: int, timer: Timer | None, hooks: Any, mark: str | None = None
) -> float:
    """Prefill ``batch`` requests, then time ``steps`` pure decode steps; returns seconds per step. With
    ``mark``, each timed step runs inside a profiler mark ``mark + index``."""
    from gpu_workers.engine import SamplingParams
    from gpu_workers.engine.core.request import EngineRequest

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.submit(engine.admit(EngineRequest.build(prompt, params)))
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    engine.step()  # the first step of pure decode (warm)
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"expected {batch} decoding requests, found {len(engine.scheduler.running)}")
    with hooks(engine, timer) if timer is not None else _nothing():
        start = time.perf_counter()
        for i in range(steps):
            if mark is None:
                engine.step()
            else:
                with torch.profiler.record_function(f"{mark}{i}"):
                    engine.step()
        elapsed = time.perf_counter() - start
    while engine.scheduler.has_unfinished():
        engine.step()
    return elapsed / steps


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def profile_table(llm: Any, prompt: list[int], batch: int, steps: int, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_steps(llm, prompt, batch, steps, None, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n")


def device_busy_ms(llm: Any, prompt: list[int], batch: int, steps: int) -> float:
    """Mean device busy time of a decode step: the union of its kernels' intervals (CUDA, torch profiler).
    0.0 off CUDA, where the trace holds no device activity: the forward's kernels run on the host thread, so
    they are host time. (The pass runs there too, so that the CPU exercises the path the GPU takes.)"""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_trace import STEP_MARK, analyze_trace

    activities = [ProfilerActivity.CPU]
    if llm.engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        decode_steps(llm, prompt, batch, steps, None, None, mark=STEP_MARK)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        rows = analyze_trace(json.loads(trace.read_text()).get("traceEvents", []))["steps"]
    return sum(r["gpu_busy_ms"] for r in rows) / len(rows) if rows else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="engine-step-") as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from gpu_workers.engine import LLM
    from sluicegate.models.smollm2 import fetch_smollm2

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(args.threads)
    torch.manual_seed(0)
    if args.model:
        path = args.model
    elif args.tiny:  # engine_gpu.py --smoke's shape
        from gpu_workers.engine.models.random_checkpoint import make_tiny_model

        path = str(make_tiny_model(tmp / "model", num_layers=2, hidden_size=64, vocab_size=512))
    else:
        path = str(fetch_smollm2(REPO / ".sluicegate" / "models"))
    blocks = args.kv_blocks or 32 * max(args.batch) + 64
    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_model_len": 512, "num_kv_blocks": blocks}
    kwargs["compile_cpu_decode"] = args.compile_cpu_decode
    kwargs["lm_head_quantization"] = args.lm_head_quantization or None
    kwargs["cpu_int4_activations"] = args.cpu_int4_activations
    if args.quantization:
        kwargs["quantization"] = args.quantization
    llm = LLM(path, **kwargs)
    tokenizer = llm.tokenizer
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    prompt = [int(i) for i in (encoded if isinstance(encoded, list) else encoded["input_ids"])]
    weights = weight_bytes_per_step(llm.engine.runner.model)
    floor_ms = 1e3 * weights / bandwidth
    result: dict[str, Any] = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "compiled_decode": llm.engine.runner.compiled_decode is not None,
        "lm_head_quantization": args.lm_head_quantization or None,
        "cpu_int4_activations": args.cpu_int4_activations,
        "kv_blocks": blocks,
        "threads": args.threads,
        # The vector ISA torch dispatches to (ATEN_CPU_CAPABILITY=avx2 forces AVX2 on an AVX-512 machine).
        "isa": torch.backends.cpu.get_cpu_capability(),
        "prompt_tokens": len(prompt),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_step": weights,
        "floor_ms": floor_ms,
        "device": str(llm.engine.device),
        "host_ms_method": (
            "step - GPU busy (union of the step's kernel intervals, torch profiler)"
            if llm.engine.device.type == "cuda"
            else "the whole step: on the CPU the forward's kernels run on the host thread"
        ),
        "batches": {},
    }
    decode_steps(llm, prompt, 1, 4, None, None)  # warm-up
    for batch in args.batch:
        coarse = Timer()
        step_s = min(decode_steps(llm, prompt, batch, args.steps, None, None) for _ in range(args.rounds))
        decode_steps(llm, prompt, batch, args.steps, coarse, coarse_phases)
        kinds = Timer()
        if not result["compiled_decode"]:  # a compiled step runs no module hooks: its layers are one graph
            decode_steps(llm, prompt, batch, args.steps, kinds, lambda e, t: layer_kinds(e.runner.model, t))
        phases = {k: 1e3 * v / args.steps for k, v in coarse.seconds.items()}
        timed_total = 1e3 * sum(coarse.seconds.values()) / args.steps
        phases["bookkeeping (rest of step)"] = max(0.0, 1e3 * step_s - timed_total)
        by_kind = {k: v / args.steps * 1e3 for k, v in kinds.seconds.items()}
        by_kind["rotary + split (rest of attention block)"] = by_kind.pop("attention block", 0.0) - sum(
            by_kind.get(k, 0.0) for k in ("qkv_proj", "o_proj", "attention + KV write")
        )
        by_kind["activation (rest of mlp block)"] = by_kind.pop("mlp block", 0.0) - sum(
            by_kind.get(k, 0.0) for k in ("gate_up_proj", "down_proj")
        )
        busy_ms = device_busy_ms(llm, prompt, batch, min(args.steps, 16))
        result["batches"][batch] = {
            "step_ms": 1e3 * step_s,
            "host_ms": max(0.0, 1e3 * step_s - busy_ms),
            "device_busy_ms": busy_ms,
            "tok_s": batch / step_s,
            "over_floor": 1e3 * step_s / floor_ms,
            "phases_ms": phases,
            "forward_by_kind_ms_hooked": by_kind,
        }
        if args.profile_dir:
            quant = f"_{args.quantization}" if args.quantization else ""
            compiled = "_compiled" if result["compiled_decode"] else ""
            name = f"engine_step_{args.dtype}{quant}{compiled}_{result['isa'].lower()}_t{args.threads}_b{batch}.txt"
            profile_table(llm, prompt, batch, min(args.steps, 16), Path(args.profile_dir) / name)
        print(
            f"batch {batch}: {1e3 * step_s:.1f} ms/step (host {result['batches'][batch]['host_ms']:.2f} ms), "
            f"{batch / step_s:.1f} tok/s",
            flush=True,
        )
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"dtype {result['dtype']}, quantization {result['quantization']}, {result['isa']}, "
        f"{result['threads']} threads, "
        f"{result['prompt_tokens']}-token prompt; read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s; "
        f"weights read per step {result['weight_bytes_per_step'] / 1e6:.0f} MB -> floor {result['floor_ms']:.1f} ms",
        f"host ms ({result['device']}): {result['host_ms_method']}",
    ]
    phases = list(next(iter(result["batches"].values()))["phases_ms"])
    lines += ["", "| batch | step ms | host ms | tok/s | x floor | " + " | ".join(phases) + " |"]
    lines.append("|" + "---|" * (5 + len(phases)))
    for batch, row in result["batches"].items():
        cells = " | ".join(f"{v:.2f}" for v in row["phases_ms"].values())
        lines.append(
            f"| {batch} | {row['step_ms']:.2f} | {row['host_ms']:.2f} | {row['tok_s']:.1f} | {row['over_floor']:.2f}x "
            f"| {cells} |"
        )
    if result.get("compiled_decode"):
        lines += ["", "Decode steps compiled: one graph a step, so no split by layer kind (see the profile table)."]
        return "\n".join(lines)
    lines += ["", "Forward by layer kind (ms per step, with hooks; shares, not timings):", ""]
    kinds = list(next(iter(result["batches"].values()))["forward_by_kind_ms_hooked"])
    lines.append("| batch | " + " | ".join(kinds) + " |")
    lines.append("|" + "---|" * (1 + len(kinds)))
    for batch, row in result["batches"].items():
        lines.append(f"| {batch} | " + " | ".join(f"{row['forward_by_kind_ms_hooked'][k]:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="clean passes per batch; the best is the figure")
    parser.add_argument("--profile-dir", default=str(REPO / "docs" / "profiles"))
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of the default model")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (2 layers, hidden 64) instead")
    parser.add_argument(
        "--compile-cpu-decode", action="store_true", help="decode steps compiled, as `sluicegate up` serves them"
    )
    parser.add_argument(
        "--lm-head-quantization", default="", help="w8a8: the LM head in int8 weights and activations, as `up` serves"
    )
    parser.add_argument(
        "--cpu-int4-activations",
        default="auto",
        help="the 4-bit layers' activations: auto (int8 where torch dispatches to AVX2, as `up` serves), int8, "
        "bfloat16",
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=0, help="KV cache blocks (default: what the batches need; a server has more)"
    )
    args = parser.parse_args(argv)
    result = run(args)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
