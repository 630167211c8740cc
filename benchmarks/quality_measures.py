"""Quality of the engine on real weights (SmolLM2-135M-Instruct): the measures behind ``benchmarks/quality.py`` and
``tests/unit/engine/test_quality_real_model.py``.

* Greedy equality: the engine's greedy tokens against transformers ``generate`` (fp32, CPU) for chat prompts that
  share a system prompt, under prefix caching, chunked prefill and recompute preemption, on any attention backend.
* Teacher forcing: a fixed text (``tests/data/quality_text.txt``) is scored by the exact model (transformers, fp32)
  and by a lossy variant (engine or transformers); per position past ``PREFILL_LEN`` the variant's top-1 is compared
  with the exact top-1 (agreement) and the text's perplexity is computed. The engine scores with ``LLM.score``: a
  prompt of ``PREFILL_LEN`` tokens, then chunks that read their whole context back from the KV cache, so an FP8
  cache is judged on the K/V that generated tokens attend, not on a prompt's fresh K/V.
* N-gram speculative decoding on a summarise-this-passage chat prompt (``spec_decode_cpu.compare_speculation``).

Triton on CPU needs ``TRITON_INTERPRET=1`` before triton's first import; callers set it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerBase

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.attention.kv_quant import CALIBRATION_HEADROOM, FP8_KV_MAX, quantize_rows
from gpu_workers.engine.quantization import fp8, quantize_model
from sluicegate.models.smollm2 import fetch_smollm2

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / ".sluicegate" / "models"
TEXT_PATH = REPO / "tests" / "data" / "quality_text.txt"
# The scored text's first tokens run as a prompt (and calibrate an FP8 cache); positions past it are measured.
PREFILL_LEN = 64
# Positions past the prompt are scored this many at a time (each chunk reads its context back from the cache).
STEP_LEN = 32
SYSTEM_PROMPT = (
    "You are a careful assistant for a small public library. Answer in plain English, in two or three short "
    "sentences, and say so when you do not know something."
)
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Why do leaves change colour in autumn?",
    "Give me one tip for learning to play the piano.",
    "How does a water mill grind grain?",
)
# Linear layer kinds of the engine's Llama (q/k/v and gate/up are fused); lm_head stays unquantized.
LAYER_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def model_path() -> Path:
    """The SmolLM2 Q4_1 GGUF, fetched once into the repository's ``.sluicegate/models``."""
    return fetch_smollm2(MODELS_DIR)


def hf_folder(gguf: Path) -> Path:
    """The Hugging Face folder the engine converts ``gguf`` into (built by the first ``LLM`` load)."""
    return gguf.with_name(gguf.stem + ".hf")


def text_ids(tokenizer: PreTrainedTokenizerBase, max_tokens: int | None = None) -> list[int]:
    """Token ids of the fixed quality text (its first ``max_tokens`` when given)."""
    ids = [int(i) for i in tokenizer(TEXT_PATH.read_text())["input_ids"]]
    return ids[:max_tokens] if max_tokens is not None else ids


def chat_ids(tokenizer: PreTrainedTokenizerBase, question: str, system: str | None = SYSTEM_PROMPT) -> list[int]:
    """A chat prompt through the model's template, ending where the assistant's reply starts."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- transformers side
class Reference:
    """The exact model in transformers (fp32, CPU): greedy continuations and full-sequence logits, each cached."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.model = load_hf(folder)
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            self._greedy[key] = out[0, len(prompt) :].tolist()
        return self._greedy[key]

    def logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._logits:
            self._logits[key] = hf_logits(self.model, ids)
        return self._logits[key]


def load_hf(folder: Path, variant: str = "fp32") -> Any:
    """transformers' model of ``folder``: ``fp32``, ``bf16``, or bitsandbytes ``bnb-int8`` / ``bnb-nf4`` (these
    need the accelerate package, as transformers' bitsandbytes loading does)."""
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if variant == "bf16":
        kwargs["dtype"] = torch.bfloat16
    elif variant in ("bnb-int8", "bnb-nf4"):
        from transformers import BitsAndBytesConfig

        if variant == "bnb-int8":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
            )
    elif variant != "fp32":
        raise ValueError(f"no transformers variant {variant!r}")
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(ids), vocab]`` of one full forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------------------------------------- teacher forcing
@dataclass(frozen=True)
class Agreement:
    """A variant against the exact model on the same positions of the same text."""

    positions: int
    top1_agreement: float
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_change(self) -> float:
        """Relative change of perplexity, ``variant / exact - 1``."""
        return self.perplexity / self.reference_perplexity - 1.0

    def row(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "top1_agreement": round(self.top1_agreement, 4),
            "perplexity": round(self.perplexity, 3),
            "reference_perplexity": round(self.reference_perplexity, 3),
            "perplexity_change_pct": round(100 * self.perplexity_change, 2),
        }


def perplexity(logits: torch.Tensor, ids: list[int], start: int) -> float:
    """exp of the mean negative log-likelihood of ``ids[start + 1:]`` given ``logits[start:-1]``."""
    targets = torch.tensor(ids[start + 1 :])
    logprobs = torch.log_softmax(logits[start:-1].float(), dim=-1)
    nll = -logprobs.gather(1, targets[:, None]).mean()
    return math.exp(float(nll))


def agreement(logits: torch.Tensor, reference: torch.Tensor, ids: list[int], start: int = PREFILL_LEN) -> Agreement:
    """Top-1 agreement and perplexity of ``logits`` against ``reference`` over positions ``start .. len - 2``."""
    same = logits[start:-1].argmax(-1) == reference[start:-1].argmax(-1)
    return Agreement(
        positions=int(same.numel()),
        top1_agreement=float(same.float().mean()),
        perplexity=perplexity(logits, ids, start),
        reference_perplexity=perplexity(reference, ids, start),
    )


def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's teacher-forced logits: a ``PREFILL_LEN`` prompt, then ``STEP_LEN`` chunks through the cache."""
    return llm.score(ids, prefill_len=PREFILL_LEN, step_len=STEP_LEN)


# Engine variants judged against the exact model: name -> LLM keyword arguments.
ENGINE_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32 (exactness check)": {"dtype": "float32"},
    "FP8 KV cache": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "bnb-int8 weights": {"dtype": "float32", "quantization": "bnb-int8"},
    "bnb-nf4 weights": {"dtype": "float32", "quantization": "bnb-nf4"},
    "FP8 weights (W8A8)": {"dtype": "float32", "quantization": "fp8"},
    "bf16": {"dtype": "bfloat16"},
    # Kept quantized on the CPU (torch's int4 / int8 kernels, run in bf16; the model bf16 unless said):
    "gguf kept: Q4_1 blocks int4, Q8_0 LM head int8": {"quantization": "gguf"},
    "gguf kept, fp32 model (bf16 kernel inputs)": {"dtype": "float32", "quantization": "gguf"},
    "cpu-int4: Q4_1 blocks int4, LM head bf16": {"quantization": "cpu-int4"},
    "cpu-int4, W8A8 LM head, bfloat16 activations": {"quantization": "cpu-int4", "lm_head_quantization": "w8a8"},
    "cpu-int4 on int8 activations, W8A8 LM head (as `up` serves on the CPU)": {
        "quantization": "cpu-int4",
        "lm_head_quantization": "w8a8",
        "cpu_int4_activations": "int8",
    },
    "cpu-int8: per-channel int8 from the Q4_1 weights": {"quantization": "cpu-int8"},
}
# The transformers variant beside each engine variant, where one runs on a CPU.
HF_PEERS: dict[str, str] = {"bnb-int8 weights": "bnb-int8", "bnb-nf4 weights": "bnb-nf4", "bf16": "bf16"}


def make_llm(gguf: Path, **kwargs: Any) -> LLM:
    """An engine on the real model, sized for the scored text and the chat prompts."""
    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("num_kv_blocks", 80)
    return LLM(str(gguf), **kwargs)


def measure_engine(gguf: Path, reference: Reference, ids: list[int], **kwargs: Any) -> Agreement:
    """One engine variant (``LLM`` keyword arguments) scored against the exact model on ``ids``."""
    llm = make_llm(gguf, **kwargs)
    return agreement(engine_logits(llm, ids), reference.logits(ids), ids)


def measure_hf(reference: Reference, variant: str, ids: list[int]) -> Agreement:
    """A transformers variant (``bf16``, ``bnb-int8``, ``bnb-nf4``) scored against the exact model on ``ids``."""
    return agreement(hf_logits(load_hf(reference.folder, variant), ids), reference.logits(ids), ids)


def measure_per_kind(gguf: Path, reference: Reference, ids: list[int], method: str) -> dict[str, Agreement]:
    """Where a weight quantization's loss comes from: ``method`` applied to one layer kind at a time (every
    layer of that kind, the rest fp32), each scored against the exact model."""
    rows: dict[str, Agreement] = {}
    for kind in LAYER_KINDS:
        llm = make_llm(gguf, dtype="float32")
        quantize_model(llm.engine.loaded.model, method, skip=lambda name, k=kind: not name.endswith("." + k))
        rows[kind] = agreement(engine_logits(llm, ids), reference.logits(ids), ids)
    return rows


def flip_margins(logits: torch.Tensor, reference: torch.Tensor, start: int = PREFILL_LEN) -> dict[str, float]:
    """How close to a tie the exact model was where the variant's top-1 differs: the exact model's top-1 minus
    top-2 logit at flipped positions (median), against the same margin over all positions."""
    top2 = reference[start:-1].topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    flipped = logits[start:-1].argmax(-1) != reference[start:-1].argmax(-1)
    return {
        "median_margin_flipped": round(float(margin[flipped].median()), 3) if bool(flipped.any()) else 0.0,
        "median_margin_all": round(float(margin.median()), 3),
    }


class FakeFp8KV:
    """An attention backend wrapper that rounds this layer's new K and/or V through e4m3 (per-KV-head scales from
    the first call, with the engine's headroom) before the wrapped backend (fp32 cache) stores and reads them:
    the FP8 cache's error, on K or V alone."""

    def __init__(self, inner: Any, keys: bool, values: bool) -> None:
        self.inner, self.keys, self.values = inner, keys, values
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.scales is None:
            self.scales = tuple(  # type: ignore[assignment]
                (t.abs().amax(dim=(0, 2)).float() * (CALIBRATION_HEADROOM / FP8_KV_MAX)).clamp(min=1e-8) for t in (k, v)
            )
        assert self.scales is not None
        if self.keys:
            k = (quantize_rows(k, self.scales[0]).float() * self.scales[0][:, None]).to(k.dtype)
        if self.values:
            v = (quantize_rows(v, self.scales[1]).float() * self.scales[1][:, None]).to(v.dtype)
        return self.inner.forward(q, k, v, *args, **kwargs)


def measure_fp8_kv_parts(gguf: Path, reference: Reference, ids: list[int]) -> dict[str, Agreement]:
    """FP8 K alone, FP8 V alone, both: rounding emulated on an fp32 cache (``FakeFp8KV``) in every layer, and
    per third of the layers (both K and V), each scored against the exact model."""
    num_layers = 30
    thirds = {f"K and V, layers {a}-{b - 1}": range(a, b) for a, b in ((0, 10), (10, 20), (20, num_layers))}
    setups: dict[str, tuple[bool, bool, range]] = {
        "K only, all layers": (True, False, range(num_layers)),
        "V only, all layers": (False, True, range(num_layers)),
        "K and V, all layers": (True, True, range(num_layers)),
    } | {name: (True, True, layers) for name, layers in thirds.items()}
    rows: dict[str, Agreement] = {}
    for name, (keys, values, layers) in setups.items():
        llm = make_llm(gguf, dtype="float32")
        for i, layer in enumerate(llm.engine.loaded.model.attention_layers):
            if i in layers:
                layer.backend = FakeFp8KV(layer.backend, keys, values)
        rows[name] = agreement(engine_logits(llm, ids), reference.logits(ids), ids)
    return rows


def measure_fp8_weight_only(gguf: Path, reference: Reference, ids: list[int]) -> Agreement:
    """FP8 weights with activations left in fp32 (``Fp8Linear``'s dequantized path), against the exact model:
    what the weights' rounding alone costs, the rest of W8A8's loss being the per-token activation rounding."""
    llm = make_llm(gguf, dtype="float32", quantization="fp8")
    key = (str(torch.device("cpu")), torch.float32)
    saved = fp8._gemm_modes.get(key)
    fp8._gemm_modes[key] = "dequantized"
    try:
        return agreement(engine_logits(llm, ids), reference.logits(ids), ids)
    finally:
        if saved is None:
            fp8._gemm_modes.pop(key, None)
        else:
            fp8._gemm_modes[key] = saved


# ---------------------------------------------------------------------------------------------- greedy equality
@dataclass(frozen=True)
class GreedyCheck:
    """One engine configuration's greedy outputs against transformers."""

    name: str
    prompts: int
    tokens_each: int
    equal: int
    prefix_hit_tokens: int
    preemptions: int
    seconds: float

    def row(self) -> dict[str, Any]:
        return self.__dict__ | {"seconds": round(self.seconds, 1)}


# name -> (LLM keyword arguments, prompts run one by one first so later ones hit the prefix cache)
GREEDY_SETUPS: dict[str, dict[str, Any]] = {
    "all at once": {},
    "prefix caching (shared system prompt)": {"staggered": True},
    "chunked prefill (max_num_batched_tokens=16)": {"max_num_batched_tokens": 16},
    "recompute preemption (num_kv_blocks=9)": {"max_model_len": 128, "num_kv_blocks": 9},
}


def check_greedy(
    gguf: Path,
    reference: Reference,
    prompts: list[list[int]],
    max_tokens: int,
    name: str,
    *,
    staggered: bool = False,
    **kwargs: Any,
) -> GreedyCheck:
    """Run ``prompts`` greedily on an engine built with ``kwargs`` (one by one when ``staggered``: the later ones
    then reuse the shared system prompt's blocks) and count those equal to transformers' tokens."""
    import time

    kwargs.setdefault("dtype", "float32")
    llm = make_llm(gguf, **kwargs)
    start = time.perf_counter()
    if staggered:
        outputs = [llm.generate([p], greedy(max_tokens))[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, greedy(max_tokens))
    seconds = time.perf_counter() - start
    equal = sum(out.token_ids == reference.greedy(p, max_tokens) for out, p in zip(outputs, prompts, strict=True))
    return GreedyCheck(
        name=name,
        prompts=len(prompts),
        tokens_each=max_tokens,
        equal=equal,
        prefix_hit_tokens=sum(out.metrics.num_cached_tokens for out in outputs),
        preemptions=sum(out.metrics.num_preemptions for out in outputs),
        seconds=seconds,
    )


# ---------------------------------------------------------------------------------------------- speculative decoding
SUMMARY_INSTRUCTION = "Summarise this passage in three sentences, reusing its own words where you can:\n\n"


def summary_prompt(tokenizer: PreTrainedTokenizerBase, max_passage_tokens: int = 300) -> list[int]:
    """A summarise-this-passage chat prompt over the first paragraphs of the quality text."""
    passage = tokenizer.decode(text_ids(tokenizer, max_passage_tokens))
    return chat_ids(tokenizer, SUMMARY_INSTRUCTION + passage, system=None)


def measure_speculation(gguf: Path, max_tokens: int, repeats: int, num_speculative_tokens: int = 4) -> dict[str, Any]:
    """N-gram speculation against plain decoding of the summary prompt, one engine, interleaved runs."""
    from benchmarks.spec_decode_cpu import compare_speculation

    spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_max": 4}
    llm = make_llm(gguf, dtype="float32", speculative_config=spec)
    prompt = summary_prompt(llm.tokenizer)
    llm.generate([prompt[:32]], greedy(2))  # warm-up
    row = compare_speculation(llm.engine, [prompt], max_tokens, repeats)
    reply = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return row | {"prompt_tokens": len(prompt), "output_tokens": max_tokens, "reply": reply.text}
