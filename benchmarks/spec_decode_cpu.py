"""Speculative decoding (n-gram, or a draft model) against plain decoding on CPU, same model, same requests, same run.

Model: a random ~56M-parameter Llama (hidden 512, 8 layers, vocab 32000, fp32), as in ``engine_cpu.py``. A random
model does not naturally quote its prompt, so the repetitive workload is built from the model's own output, the
way an edit / rewrite request repeats its source: for each random prompt P, the plain engine first generates its
greedy continuation O (``--output-tokens`` tokens); the measured prompt is ``P + O + P``, so a model that continues
as before reproduces O, and the n-gram proposer finds it in the prompt. Whether the target really repeats O is up
to the model: the acceptance rate printed is measured, not assumed. ``--workload random`` runs plain random prompts
instead (no built-in repetition; whatever loops the random model falls into are all the proposer gets).

``--method draft_model`` drafts with a second model of the same tokenizer instead, with ``--draft``:
``random`` (a separate random model, 2 layers of hidden 128: it knows nothing of the target, the honest floor) or
``predictable`` (the mechanism's payoff when the draft is good). A random model's layers each move its output
(even the first 7 of 8 layers, cut off, greedy-decode other tokens), so no cut of it makes a good draft. For
``predictable`` the target is rewritten so that its layers past the first ``--draft-layers`` write nothing to the
residual stream (their ``o_proj`` and ``down_proj`` are zero): it still runs every layer, but computes what its
first layers compute, and the draft is exactly those layers. Acceptance is then ~1 and the draft costs
``--draft-layers`` / ``num_layers`` of the target's layers: the bound of what a well-matched draft gives on this
machine, not a claim about trained models.

Each request generates ``--output-tokens`` greedy tokens (EOS ignored); ``--batch`` requests run at once. One
engine runs plain and speculative alternately ``--repeats`` times (its speculator switched off and on; the box may
be shared) and each keeps its best wall time. Both outputs are checked equal token for token.
Usage: ``python benchmarks/spec_decode_cpu.py`` (about a minute on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file, save_file

from gpu_workers.engine import EngineConfig, LLMEngine, SamplingParams
from gpu_workers.engine.models.random_checkpoint import make_tiny_model


def build_model(out_dir: Path, quick: bool) -> Path:
    if quick:
        return make_tiny_model(out_dir, arch="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                               vocab_size=2048, init_std=0.02)  # fmt: skip
    return make_tiny_model(out_dir, arch="llama", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                           vocab_size=32000, init_std=0.02)  # fmt: skip


def build_draft(kind: str, target: Path, out_dir: Path, layers: int, quick: bool) -> tuple[Path, Path]:
    """(target, draft) folders: the target unchanged and a separate small random draft, or (``predictable``) a
    copy of the target whose layers past the first ``layers`` are silenced and the draft made of those layers."""
    config = json.loads((target / "config.json").read_text())
    if kind == "random":
        draft = make_tiny_model(out_dir / "draft", arch="llama", num_layers=2, hidden_size=64 if quick else 128,
                                num_heads=4, num_kv_heads=2, vocab_size=config["vocab_size"], init_std=0.02,
                                seed=7)  # fmt: skip
        return target, draft
    if kind != "predictable":
        raise ValueError(f"unknown draft kind {kind!r}")
    if not 0 < layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be in [1, {config['num_hidden_layers'] - 1}], got {layers}")
    silenced, draft = out_dir / "target", out_dir / "draft"
    silenced.mkdir(parents=True)
    draft.mkdir()
    kept = {}
    for shard in sorted(target.glob("*.safetensors")):  # one file or a sharded checkpoint's shards
        tensors = load_file(str(shard))
        for name, tensor in tensors.items():
            index = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            if index >= layers and name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                tensor.zero_()  # this layer adds nothing to the residual stream
            if index < layers:
                kept[name] = tensor
        save_file(tensors, str(silenced / shard.name), metadata={"format": "pt"})
    save_file(kept, str(draft / "model.safetensors"), metadata={"format": "pt"})
    (draft / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    for extra in target.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors"):  # config, shard index, tokenizer files
            shutil.copy(extra, silenced / extra.name)
            if extra.name != "config.json" and ".safetensors" not in extra.name:
                shutil.copy(extra, draft / extra.name)
    return silenced, draft


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Submit every prompt at once, step until all finish; wall seconds and each request's tokens."""
    start = time.perf_counter()
    ids = [engine.add_request(p, _greedy(max_tokens)) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return time.perf_counter() - start, [tokens[rid] for rid in ids]


def edit_workload(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> list[list[int]]:
    """``P + O + P`` per prompt P, O being the engine's greedy continuation of P (an edit / rewrite request)."""
    _, outputs = generate_greedy(engine, prompts, output_tokens)
    return [p + o + p for p, o in zip(prompts, outputs, strict=True)]


def compare_speculation(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, repeats: int, *, exact: bool = True
) -> dict[str, Any]:
    """Plain and speculative decoding of the same greedy requests on one engine (its speculator switched off and
    on between interleaved runs): best tok/s of each, their ratio, and the speculative runs' acceptance.

    ``exact`` (fp32) raises when speculation changes a greedy token. In bf16 on a GPU, verifying k+1 tokens
    per sequence runs other GEMM shapes than a 1-token decode, so a near-tied logit of a random-weight model
    may round the other way: then the share of requests whose output is identical is reported instead."""
    speculator = engine.speculator
    if speculator is None:
        raise ValueError("the engine was built without speculative_config")
    best = {"plain": float("inf"), "spec": float("inf")}
    drafts = draft_tokens = accepted = 0
    identical = 0
    for _ in range(repeats):
        engine.speculator = None
        wall_plain, out_plain = generate_greedy(engine, prompts, max_tokens)
        engine.speculator = speculator
        before = (speculator.num_drafts, speculator.num_draft_tokens, speculator.num_accepted_tokens)
        wall_spec, out_spec = generate_greedy(engine, prompts, max_tokens)
        drafts += speculator.num_drafts - before[0]
        draft_tokens += speculator.num_draft_tokens - before[1]
        accepted += speculator.num_accepted_tokens - before[2]
        if exact and out_plain != out_spec:
            raise RuntimeError("speculative greedy output differs from plain greedy output")
        identical += sum(a == b for a, b in zip(out_plain, out_spec, strict=True))
        best["plain"] = min(best["plain"], wall_plain)
        best["spec"] = min(best["spec"], wall_spec)
    tokens = len(prompts) * max_tokens
    return {
        "plain_tok_s": round(tokens / best["plain"], 1),
        "spec_tok_s": round(tokens / best["spec"], 1),
        "speedup": round(best["plain"] / best["spec"], 2),
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else 0.0,
        "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else 0.0,
        "verification_steps": drafts,
        "identical_outputs": round(identical / (repeats * len(prompts)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", choices=["repeat", "random"], default="repeat")
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    parser.add_argument("--draft", choices=["random", "predictable"], default="predictable")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model", args.quick)
        spec_config: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
        if args.method == "ngram":
            spec_config["prompt_lookup_max"] = args.prompt_lookup_max
        else:
            path, draft = build_draft(args.draft, path, Path(tmp) / "spec", args.draft_layers, args.quick)
            spec_config["model"] = str(draft)
        engine = LLMEngine(EngineConfig(str(path), max_model_len=2048, max_num_seqs=64, speculative_config=spec_config))
        rng = random.Random(args.seed)
        vocab = engine.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
        if args.workload == "repeat":
            prompts = edit_workload(engine, prompts, args.output_tokens)
        generate_greedy(engine, [p[:16] for p in prompts[:2]], 4)  # warm-up
        row = compare_speculation(engine, prompts, args.output_tokens, args.repeats)
    draft_label = ""
    if args.method == "draft_model":
        draft_label = f" draft={args.draft}" + (f" ({args.draft_layers} layers)" if args.draft == "predictable" else "")
    print(
        f"workload={args.workload} batch={args.batch} prompt={len(prompts[0])} tokens output={args.output_tokens} "
        f"k={args.num_speculative_tokens} threads={args.threads} repeats={args.repeats} method={args.method}"
        + draft_label
    )
    print(
        f"plain {row['plain_tok_s']} tok/s, {args.method} {row['spec_tok_s']} tok/s, speedup {row['speedup']}x; "
        f"acceptance rate {row['acceptance_rate']}, mean accepted length {row['mean_accepted_length']} tokens per "
        f"verification step ({row['verification_steps']} steps)"
    )


if __name__ == "__main__":
    main()
