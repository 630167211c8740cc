"""Gemma 3's sliding layers' KV memory against full attention at 8k tokens, measured in the engine's own block
manager: how many KV blocks one request holds while it prefills and decodes ``context`` tokens.

Two engines run the same random Gemma 3 (Gemma 3 1B's layout of 5 sliding layers to 1 global, scaled down to
``layers`` layers; window ``window``), one request of ``context - decode`` prompt tokens plus ``decode`` output
tokens, chunked prefill of ``chunk`` tokens a step:

* ``full``: every layer global (``layer_types`` all ``full_attention``): the table holds every block;
* ``sliding``: every layer sliding: the block manager releases the blocks behind the window.

After every step the request's live blocks (``block_ids`` less the released entries) and the pool's free count
are read; the figures are the peak and the final count, and bytes = blocks x the bytes a block of one layer
takes (K and V) x layers. The real Gemma 3 mixes both kinds; served today it keeps every block for all layers
(the ``full`` figure: one block table for both kinds). ``hybrid with per-group tables`` is what a table per layer
kind would hold: the measured ``full`` blocks for its global layers plus the measured ``sliding`` blocks for its
sliding layers, at Gemma 3 1B's geometry (26 layers, 1 KV head of dim 256, bfloat16).

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
from gpu_workers.engine.core.block_manager import NULL_BLOCK
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

# Gemma 3 1B: 26 layers, every 6th global; 1 KV head of dim 256; bfloat16 weights and cache.
GEMMA3_1B = dict(layers=26, global_every=6, kv_heads=1, head_dim=256, dtype_bytes=2)


def _set_layer_kinds(folder: Path, kind: str) -> None:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["layer_types"] = [kind] * config["num_hidden_layers"]
    config_file.write_text(json.dumps(config))


def measure(folder: Path, context: int, decode: int, chunk: int, block_size: int) -> dict[str, Any]:
    """Blocks one request holds, peak and at the end, over its prefill and decode."""
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), max_model_len=context + 1, num_kv_blocks=-(-context // block_size) + 8,
            block_size=block_size, max_num_batched_tokens=chunk, enable_prefix_caching=False, dtype="float32",
        )
    )  # fmt: skip
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(context - decode)]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True))
    total = engine.num_total_blocks
    peak = peak_in_use = last = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            last = sum(b != NULL_BLOCK for b in seq.block_ids)
            peak = max(peak, last)
        peak_in_use = max(peak_in_use, total - engine.num_free_blocks)
    return {"peak_blocks": peak, "final_blocks": last, "peak_pool_blocks_in_use": peak_in_use}


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
        base = make_tiny_model(
            Path(tmp) / "gemma3", arch="gemma3", num_layers=args.layers, head_dim=32,
            sliding_window=args.window, max_position_embeddings=args.context + 1,
        )  # fmt: skip
        for kind, layer_type in (("full", "full_attention"), ("sliding", "sliding_attention")):
            _set_layer_kinds(base, layer_type)
            results[kind] = measure(base, args.context, args.decode, args.chunk, args.block_size)
    g = GEMMA3_1B
    per_layer_block = 2 * args.block_size * g["kv_heads"] * g["head_dim"] * g["dtype_bytes"]
    num_global = g["layers"] // g["global_every"]
    full_blocks, sliding_blocks = results["full"]["final_blocks"], results["sliding"]["final_blocks"]
    served = full_blocks * g["layers"] * per_layer_block
    grouped = (full_blocks * num_global + sliding_blocks * (g["layers"] - num_global)) * per_layer_block
    results["gemma3_1b_bytes"] = {
        "served_today_one_table": served,
        "hybrid_with_per_group_tables": grouped,
        "saving": round(served / grouped, 2),
        "all_sliding_over_full_blocks": round(sliding_blocks / full_blocks, 4),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
