"""Shared fixtures for the engine tests: tiny random models built once per session, a cached
transformers greedy reference, and an ``LLM`` factory that checks every engine ends leak-free."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gpu_workers.engine import LLM
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.models.rotary import uses_long_factors

# The tiny models are cheap; keep intra-op threads low so the suite behaves on a shared 2-core box.
torch.set_num_threads(1)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def longrope(rotary_dim: int, original_max_position_embeddings: int = 64) -> dict[str, Any]:
    """Phi-3 style LongRoPE: distinct short and long factors per frequency (the long ones stretch the low
    frequencies most, as the real ones do); prompts here cross the original length, so both sets matter."""
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 1.5 * i for i in range(half)],
        "original_max_position_embeddings": original_max_position_embeddings,
    }


MODEL_VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral", seed=1),
    "qwen2": dict(arch="qwen2", seed=2),
    # Qwen3: per-head query/key norms, and a head_dim that is not hidden_size / num_heads.
    "qwen3": dict(arch="qwen3", seed=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32),
    # Mistral with a window far shorter than most prompts: every layer slides, blocks behind it are released.
    "mistral_sliding": dict(arch="mistral", seed=5, sliding_window=48),
    # Gemma 3: sliding and global layers interleaved (window 48), (1 + w) norms before and after attention and
    # MLP, q/k norms, GeGLU, local/global RoPE bases (linear scaling on the global one), a final soft-cap
    # (untied: tied random embeddings repeat one token; the vision-language variant covers the tied head).
    "gemma3": dict(
        arch="gemma3", seed=6, num_layers=3, head_dim=32, sliding_window=48,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    # Llama 3 style: tied embeddings, llama3 RoPE scaling, large theta, 4:1 GQA.
    "llama3_tied": dict(
        arch="llama", seed=3, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
        num_heads=8, num_kv_heads=2,
    ),
    # Phi-3 (128k style): fused checkpoint projections, LongRoPE with an original length of 64 tokens.
    "phi3_longrope": dict(arch="phi3", seed=5, max_position_embeddings=512, rope_scaling=longrope(16)),
    # Phi-4-mini style: 3/4 of each head rotates (12 of 16 dims), LongRoPE on those, tied embeddings, 4:1 GQA.
    "phi4mini": dict(
        arch="phi3", seed=6, max_position_embeddings=512, tie_word_embeddings=True, num_heads=4, num_kv_heads=1,
        rope_scaling={**longrope(12), "partial_rotary_factor": 0.75},
    ),
    # Mixture of experts: Mixtral's top-2 of 8 experts, renormalized; Qwen3-MoE's top-4 of 8 not renormalized
    # (norm_topk_prob off), qk norms, and layer 1 dense (mlp_only_layers). test_engine_moe.py checks that these
    # suites' prompts route tokens to every expert of every sparse layer.
    "mixtral": dict(arch="mixtral", seed=5),
    "qwen3_moe": dict(
        arch="qwen3_moe", seed=7, num_layers=3, head_dim=32,
        config_overrides=dict(num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    # Phi-3-mini-4k's and Mixtral's windows slide every layer as Mistral's does (transformers masks them too).
    "phi3_sliding": dict(arch="phi3", seed=8, sliding_window=40),
    "mixtral_sliding": dict(arch="mixtral", seed=9, sliding_window=56),
}  # fmt: skip

# Prompt lengths straddle block boundaries (block size 16) and reach 300 tokens.
PROMPT_LENGTHS = [1, 2, 15, 16, 17, 31, 33, 64, 100, 129, 150, 200, 255, 256, 257, 300]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``model_dir(variant)`` -> folder of that tiny model, built on first use."""
    root = tmp_path_factory.mktemp("engine_models")
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_tiny_model(root / variant, **MODEL_VARIANTS[variant])
        return built[variant]

    return get


def random_prompts(seed: int, vocab_size: int = 512) -> list[tuple[list[int], int]]:
    """16 (prompt ids, max_tokens) pairs with lengths ``PROMPT_LENGTHS`` and 1..64 new tokens."""
    rng = random.Random(seed)
    max_tokens = [1, 64] + [rng.randint(1, 64) for _ in PROMPT_LENGTHS[2:]]
    rng.shuffle(max_tokens)
    pairs = zip(PROMPT_LENGTHS, max_tokens, strict=True)
    return [([rng.randrange(3, vocab_size) for _ in range(n)], m) for n, m in pairs]


def shared_prefix_prompts(seed: int, vocab_size: int = 512) -> list[tuple[list[int], int]]:
    """16 prompts built on two long prefixes (96 and 200 tokens), including exact repeats and a
    prompt that is exactly a block-aligned prefix (its last token must still be recomputed)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (96, 200)]
    prompts: list[tuple[list[int], int]] = []
    for i in range(15):
        prefix = prefixes[i % 2]
        if i in (2, 3):
            suffix: list[int] = []
        else:
            suffix = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 60))]
        prompts.append((prefix + suffix, rng.randint(1, 48)))
    prompts.append(prompts[5])  # an exact duplicate of an earlier request
    return prompts


def pin_longrope_factors(model: Any, max_model_len: int) -> None:
    """Make a transformers LongRoPE model use the factor set the engine picks for ``max_model_len`` at every
    length. transformers switches to the long factors once the sequence in hand passes the original length
    (its cached keys keep the short ones); the engine picks one set per engine (``models/rotary.py``), so a
    prompt shorter than the original length would otherwise be compared across two different RoPEs. The
    factors and the attention scaling stay transformers' own; ``test_phi3.py`` checks the unpinned model too."""
    config = model.config
    if not uses_long_factors(config, max_model_len):
        return
    rotary = model.model.rotary_emb
    original = int(config.rope_parameters["original_max_position_embeddings"])
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, rotary.original_inv_freq.device, seq_len=original + 1)
    rotary.original_inv_freq.copy_(long_inv_freq)


class HFReference:
    """Greedy continuations from transformers ``generate`` (batch of one, no padding), cached."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}
        self._cache: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}

    def greedy(self, path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (path, tuple(prompt), max_new_tokens)
        if key not in self._cache:
            if path not in self._models:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
                # generate() fills unset fields from the model's defaults; drop EOS there too.
                model.generation_config.eos_token_id = None
                pin_longrope_factors(model, MAX_MODEL_LEN)
                self._models[path] = model
            model = self._models[path]
            # No EOS: exactly max_new_tokens tokens, matching the engine's ignore_eos=True.
            config = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=None
            )
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            continuation = out[0, len(prompt) :].tolist()
            assert len(continuation) == max_new_tokens
            self._cache[key] = continuation
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


def assert_pool_whole(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished(), "requests left in the engine"
    assert engine.num_free_blocks == engine.num_total_blocks, (
        f"KV blocks leaked: {engine.num_total_blocks - engine.num_free_blocks} still referenced"
    )
    # A hybrid KV cache has a manager per layer group: every one of them must be whole.
    for manager in getattr(engine.block_manager, "groups", (engine.block_manager,)):
        assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked in a layer group"
        assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Factory for ``LLM``s; after the test every one of them must be idle with its pool whole."""
    created: list[LLM] = []

    def factory(model: Path | str, **kwargs: Any) -> LLM:
        kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
        kwargs.setdefault("num_kv_blocks", 256)
        llm = LLM(str(model), **kwargs)
        created.append(llm)
        return llm

    yield factory
    for llm in created:
        assert_pool_whole(llm)
