"""Greedy tokens of the engine against transformers ``generate`` on one device, per attention path.

The engine's reference of truth (docs/design.md) is that greedy decoding gives exactly the tokens transformers
gives for the same model and prompts in fp32. The unit tests check it on the CPU; this script checks it on
a GPU for every path the GPU adds: the torch backend on CUDA tensors, the compiled Triton kernels with
CUDA graphs off and on, flash-attn when installed, and the Triton path with prefix caching, cascade
attention, chunked prefill, and n-gram and draft-model speculation. Models are small random-weight
checkpoints built here (Llama 3 style with tied embeddings and llama3 RoPE, Qwen2 with biases, Mistral
with one KV head), fp32, TF32 off.

A mismatch is reported with where it starts and how close the reference's top two logits were there
(teacher-forced): a gap below ~1e-4 is a rounding tie, not a bug. Writes ``$OUT/gpu_parity.json``
after every case, so a run cut short keeps what it measured.

Usage: ``PYTHONPATH=. python3 -m benchmarks.gpu_parity`` on a GPU; ``--smoke`` runs the torch and
interpreted Triton paths on the CPU with fewer prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    # Triton reads this at its first import: the kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
MODELS: dict[str, dict[str, Any]] = {
    "llama3_tied": dict(
        arch="llama", seed=3, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
        num_heads=8, num_kv_heads=2, hidden_size=128, num_layers=3, vocab_size=1024,
    ),
    "qwen2": dict(arch="qwen2", seed=2, hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=2,
                  vocab_size=1024),
    "mistral": dict(arch="mistral", seed=1, hidden_size=128, num_heads=4, num_kv_heads=1, num_layers=2,
                    vocab_size=1024),
}  # fmt: skip
# Lengths straddle 16-token block boundaries; the shared-prefix batch exercises prefix caching and cascade.
PROMPT_LENGTHS = (1, 15, 16, 17, 33, 100, 129, 257)
# Reference top-2 logit gaps below which a flipped token is a rounding tie, per dtype.
GAP_TIE = {"float32": 1e-4, "bfloat16": 5e-2}


@dataclass(frozen=True)
class Case:
    """One engine configuration compared with the reference."""

    name: str
    backend: str
    enforce_eager: bool = True
    prefix_caching: bool = False
    max_num_batched_tokens: int = 8192
    shared_prefix: bool = False
    dtype: str = "float32"
    # "ngram" or "draft_model" (the model itself as its draft: every draft accepted, the rollback paths idle).
    speculative: str | None = None


def cases(device: str) -> list[Case]:
    if device == "cpu":
        return [
            Case("torch", "torch"),
            Case("triton (interpreter)", "triton"),
            Case("triton, prefix caching + chunked prefill", "triton", True, True, 64, True),
            Case("torch, n-gram speculation", "torch", shared_prefix=True, speculative="ngram"),
        ]
    found = [
        Case("torch", "torch"),
        Case("triton, eager", "triton"),
        Case("triton, CUDA graphs", "triton", enforce_eager=False),
        Case("triton, CUDA graphs, prefix caching + cascade", "triton", False, True, 8192, True),
        Case("triton, chunked prefill (64-token budget) + prefix caching", "triton", True, True, 64, True),
        Case("triton, CUDA graphs, n-gram speculation", "triton", False, True, 8192, True, speculative="ngram"),
        Case("triton, CUDA graphs, draft-model speculation", "triton", False, True, speculative="draft_model"),
    ]
    try:
        import flash_attn  # noqa: F401

        found.append(Case("flash_attn (bf16 engine and reference)", "flash_attn", False, True, 8192, True, "bfloat16"))
    except ImportError:
        pass
    return found


@dataclass
class Prompts:
    plain: list[list[int]]
    shared: list[list[int]]
    max_tokens: int


def make_prompts(vocab: int, smoke: bool) -> Prompts:
    rng = random.Random(0)
    lengths = PROMPT_LENGTHS[:5] if smoke else PROMPT_LENGTHS
    plain = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    prefix = [rng.randrange(3, vocab) for _ in range(40 if smoke else 300)]
    shared = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 30))] for _ in range(3 if smoke else 6)]
    # A prompt that repeats itself, so n-gram lookup finds drafts (and some are rejected).
    shared.append(prefix + prefix[:50])
    return Prompts(plain, shared, 8 if smoke else 24)


class Reference:
    """transformers greedy continuations (batch of one, no EOS) and teacher-forced logit gaps."""

    def __init__(self, path: Path, device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
        self.model.generation_config.eos_token_id = None
        self._cache: dict[tuple[int, ...], list[int]] = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        from transformers import GenerationConfig

        if tuple(prompt) not in self._cache:
            ids = torch.tensor([prompt], device=self.device)
            config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=None)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            self._cache[tuple(prompt)] = out[0, len(prompt) :].tolist()
        return self._cache[tuple(prompt)]

    @torch.no_grad()
    def gap(self, tokens: list[int]) -> float:
        """Top-1 minus top-2 logit of the reference's next token after ``tokens``."""
        logits = self.model(torch.tensor([tokens], device=self.device)).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])


@dataclass
class CaseResult:
    name: str
    model: str
    prompts: int = 0
    equal: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def row(self) -> dict[str, Any]:
        return self.__dict__ | {"all_equal": self.error is None and self.equal == self.prompts}


def run_case(case: Case, model: str, path: Path, device: str, prompts: Prompts, ref: Reference) -> CaseResult:
    result = CaseResult(case.name, model)
    start = time.perf_counter()
    llm = LLM(
        str(path),
        device=device,
        dtype=case.dtype,
        attention_backend=case.backend,
        enforce_eager=case.enforce_eager,
        enable_prefix_caching=case.prefix_caching,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_model_len=1024,
        max_num_seqs=16,
        num_kv_blocks=256,
        speculative_config=(
            None
            if case.speculative is None
            else {"method": case.speculative} | ({"model": str(path)} if case.speculative == "draft_model" else {})
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=prompts.max_tokens, ignore_eos=True)
    batches = [prompts.plain]
    if case.shared_prefix:
        # The prefix is cached before the batch that shares it arrives (a hit, then cascade decodes).
        llm.generate([prompts.shared[0]], params)
        batches.append(prompts.shared)
    for batch in batches:
        outputs = llm.generate(batch, params)
        for prompt, out in zip(batch, outputs, strict=True):
            want = ref.greedy(prompt, prompts.max_tokens)
            result.prompts += 1
            if out.token_ids == want:
                result.equal += 1
                continue
            at = next(i for i, (a, b) in enumerate(zip(out.token_ids, want, strict=False)) if a != b)
            result.mismatches.append(
                {"prompt_len": len(prompt), "first_diff": at, "ref_gap": ref.gap(prompt + want[:at])}
            )
    result.seconds = time.perf_counter() - start
    del llm
    return result


def run_guarded(
    case: Case, model: str, path: Path, device: str, prompts: Prompts, refs: dict[str, Reference]
) -> dict[str, Any]:
    """``run_case``'s row, the reference of the case's dtype built once into ``refs``; an exception becomes the
    row's error (one broken path must not hide the others). The row carries the dtype's tie gap."""
    try:
        ref = refs.get(case.dtype) or refs.setdefault(case.dtype, Reference(path, device, getattr(torch, case.dtype)))
        row = run_case(case, model, path, device, prompts, ref).row()
    except Exception as exc:
        traceback.print_exc()
        row = CaseResult(case.name, model, error=repr(exc)[:2000]).row()
    return row | {"tie": GAP_TIE[case.dtype]}


def write(results: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        target = Path(out) / "gpu_parity.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
        target.with_suffix(".tmp").replace(target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: torch + interpreted Triton, fewer prompts")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; use --smoke on a CPU")
    # Exact fp32 on both sides: TF32 would round each product to 10 mantissa bits.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU", "cases": []}
    models = ["llama3_tied"] if args.smoke else list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            path = make_tiny_model(Path(tmp) / model, **MODELS[model])
            prompts = make_prompts(MODELS[model]["vocab_size"], args.smoke)
            refs: dict[str, Reference] = {}
            for case in cases(device):
                if model != "llama3_tied" and (case.shared_prefix or case.dtype != "float32"):
                    continue  # the other architectures differ in weights and layout, not in attention paths
                row = run_guarded(case, model, path, device, prompts, refs)
                results["cases"].append(row)
                write(results)
                verdict = "EQUAL" if row["all_equal"] else "ERROR" if row["error"] else "DIFFERS"
                gaps = [m["ref_gap"] for m in row["mismatches"]]
                print(
                    f"{model:<12} {case.name:<58} {row['equal']}/{row['prompts']} {verdict}"
                    + (f" (ref top-2 gaps at first diff: {', '.join(f'{g:.2e}' for g in gaps)})" if gaps else "")
                    + (f" {row['error']}" if row["error"] else ""),
                    flush=True,
                )
            del refs
    # A difference on a reference tie is rounding; anything else is a failure.
    real = [r for r in results["cases"] if r["error"] or any(m["ref_gap"] > r["tie"] for m in r["mismatches"])]
    results["failures"] = [f"{r['model']}: {r['name']}" for r in real]
    write(results)
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
