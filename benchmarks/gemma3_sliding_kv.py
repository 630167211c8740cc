"""Gemma 3's KV memory at 8k tokens with the hybrid KV cache against all-global, measured in the engine's own
block managers: how many KV blocks one request holds, per layer group, while it prefills and decodes.

Two engines run the same random Gemma 3 (Gemma 3 1B's layout of 5 sliding layers to 1 global, scaled down to
``layers`` layers; window ``window``), one request of ``context - decode`` prompt tokens plus ``decode`` output
tokens, chunked prefill of ``chunk`` tokens a step:

* ``all_global``: ``enable_hybrid_kv_cache=False``: one block table for every layer, every block kept;
* ``hybrid``: a table and pool per layer group (``core/kv_groups.py``): the full group keeps every block, the
  sliding group gives back the blocks behind its window.

After every step each group's blocks in use are read from its manager (measured, not projected); the figures
are the peak and the final count. Bytes = blocks x layers of the group x the bytes one layer's block takes (K and
V), at the test model's geometry and at Gemma 3 1B's (26 layers of which 4 global, 1 KV head of dim 256,
bfloat16), the group block counts being the measured ones.

Usage: ``PYTHONPATH=. python3 benchmarks/gemma3_sliding_kv.py`` (``--context 8192 --window 512`` by default);
prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_workers.engine import EngineConfig, LLMEngine, SamplingParams
from gpu_workers.engine.core.kv_groups import HybridKVBlockManager
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

# Gemma 3 1B: 26 layers, every 6th global; 1 KV head of dim 256; bfloat16 weights and cache.
GEMMA3_1B = dict(layers=26, global_every=6, kv_heads=1, head_dim=256, dtype_bytes=2)


def measure(folder: Path, context: int, decode: int, chunk: int, block_size: int, hybrid: bool) -> dict[str, Any]:
    """Blocks in use per layer group (one group without ``hybrid``), peak and at the end, over one request."""
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), max_model_len=context + 1, num_kv_blocks=-(-context // block_size) + 8,
            block_size=block_size, max_num_batched_tokens=chunk, max_num_seqs=2, enable_prefix_caching=False,
            dtype="float32", enable_hybrid_kv_cache=hybrid,
        )
    )  # fmt: skip
    bm = engine.block_manager
    groups = bm.groups if isinstance(bm, HybridKVBlockManager) else (bm,)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(context - decode)]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True))
    peak = [0] * len(groups)
    last = [0] * len(groups)
    while engine.has_unfinished():
        engine.step()
        if engine.scheduler.running:
            last = [g.num_blocks - g.num_free_blocks for g in groups]
            peak = [max(p, n) for p, n in zip(peak, last, strict=True)]
    return {"group_pool_blocks": [g.num_blocks for g in groups], "peak_blocks": peak, "final_blocks": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    results: dict[str, Any] = {"context": args.context, "window": args.window, "block_size": args.block_size}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(
            Path(tmp) / "gemma3", arch="gemma3", num_layers=args.layers, head_dim=32,
            sliding_window=args.window, max_position_embeddings=args.context + 1,
        )  # fmt: skip
        for name, hybrid in (("all_global", False), ("hybrid", True)):
            results[name] = measure(folder, args.context, args.decode, args.chunk, args.block_size, hybrid)
    g = GEMMA3_1B
    per_layer_block = 2 * args.block_size * g["kv_heads"] * g["head_dim"] * g["dtype_bytes"]
    num_global = g["layers"] // g["global_every"]
    (one_table,) = results["all_global"]["final_blocks"]
    full_blocks, sliding_blocks = results["hybrid"]["final_blocks"]
    served = one_table * g["layers"] * per_layer_block
    grouped = (full_blocks * num_global + sliding_blocks * (g["layers"] - num_global)) * per_layer_block
    results["gemma3_1b_bytes"] = {
        "all_global": served,
        "hybrid": grouped,
        "saving": round(served / grouped, 2),
        "sliding_over_full_blocks": round(sliding_blocks / full_blocks, 4),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
