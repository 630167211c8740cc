"""Writes a small random-weight Llama/Mistral/Qwen2/Qwen3/Phi-3/Mixtral/Qwen3-MoE/Gemma 3 checkpoint plus a trained
byte-level BPE tokenizer as an ordinary Hugging Face folder, for tests, demos and benchmarks without downloads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Each ``arch``: transformers' config class and the ``architectures`` name its checkpoints carry.
ARCHS: dict[str, tuple[type, str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
    "phi3": (Phi3Config, "Phi3ForCausalLM"),
    "mixtral": (MixtralConfig, "MixtralForCausalLM"),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM"),
    # Gemma 3's vision-language layout (a tiny vision tower beside the language model), served text-only.
    "gemma3_mm": (Gemma3Config, "Gemma3ForConditionalGeneration"),
}
# Config fields an architecture gets unless ``config_overrides`` sets them: small expert counts for the MoE models
# (their library defaults are Mixtral-8x7B's and Qwen3-30B-A3B's).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
# Qwen3's way of switching thinking (``chat_template_kwargs: {"enable_thinking": false}`` closes an empty
# <think> span in the prompt), in ChatML; ``open_think`` mimics the thinking-only releases that open it themselves.
THINKING_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}"
)
# Phi-3 / Phi-4-mini's turn markers and template (Phi-4-mini's: no newlines): a turn ends with <|end|>, which the
# generation config lists as an EOS beside <|endoftext|>, as the real checkpoints do.
PHI3_SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

_CORPUS = """\
The river ran quietly past the old mill, where the wheel had not turned for many years.
Children came in the summer to throw stones into the water and watch the rings spread out.
In the town square a baker opened his shop before dawn, and the smell of fresh bread
drifted down every street. People walked to work, talked about the weather, and argued
about the price of coffee. A message queue carries requests from one service to another;
a worker reads each message, runs the model, and writes the tokens back to a stream.
Large language models predict the next token from the tokens before it. Each layer mixes
information across positions with attention and then transforms every position on its own.
The cache keeps the keys and values of earlier tokens so that they need not be computed again.
When many requests share the same beginning, their first blocks can be reused by all of them.
She asked what time the train would leave, and he said it would leave at seven in the evening.
They counted one, two, three, four, five, six, seven, eight, nine, ten and started over again.
Numbers like 2026, 3.14 and 42 appear in text, as do symbols such as #, %, & and @.
Good software is tested, measured and explained; bad input gets a clear error message.
"""


# A vision tower as small as SigLIP allows: a Gemma 3 vision-language checkpoint needs one to exist.
_TINY_VISION: dict[str, Any] = dict(
    model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, image_size=32, patch_size=8,
)  # fmt: skip


def _gemma3_text_kwargs(
    num_layers: int, sliding_window: int | None, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> dict[str, Any]:
    """Gemma 3 specifics: every other layer slides (the last is global), local and global RoPE bases with
    scaling on the global one, an attention scale apart from head_dim, and a final logit soft-cap."""
    global_rope: dict[str, Any] = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta * 100}
    return dict(
        sliding_window=sliding_window or 4096,
        layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": rope_theta},
            "full_attention": global_rope,
        },
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_tokenizer(
    vocab_size: int, extra_special: Sequence[str] = (), chat_template: str = CHAT_TEMPLATE, eos_token: str = "</s>"
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the built-in corpus, padded to exactly ``vocab_size``.
    ``extra_special``: more special tokens (an architecture's turn markers), ``eos_token`` among them or ``</s>``.

    A small corpus cannot supply tens of thousands of merges, so the remainder of the vocabulary
    is filled with plain added tokens ``<|extra_N|>``; every model id then decodes to something.
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token=eos_token,
        pad_token="<pad>",
        chat_template=chat_template,
    )
    if extra_special:
        # Marked special, so decoding with skip_special_tokens drops them (an end-of-turn token is no text).
        fast.add_special_tokens({"additional_special_tokens": list(extra_special)})
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, expected {vocab_size}")
    return fast


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    init_std: float = 0.1,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    chat_template: str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``generation_config.json`` and tokenizer files
    for a random model into ``out_dir`` (created if needed) and return its path.

    ``init_std`` is larger than the usual 0.02 so greedy decoding produces varied tokens rather
    than one token forever. ``intermediate_size`` defaults to ~8/3 x hidden, rounded up to 32.
    ``max_shard_size`` (e.g. ``"200KB"``) splits the weights into an indexed, sharded checkpoint.
    ``head_dim`` defaults to ``hidden_size // num_heads`` (Qwen3 and Gemma set it apart from the hidden size).
    ``sliding_window``: the window of every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE) or of Gemma 3's sliding
    layers; None for full attention.
    ``chat_template`` replaces the tokenizer's (e.g. ``THINKING_CHAT_TEMPLATE``).
    ``config_overrides``: more fields of the architecture's config (e.g. ``num_experts``), over ``ARCH_DEFAULTS``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None and hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "phi3":
        tokenizer = build_tokenizer(vocab_size, PHI3_SPECIAL_TOKENS, PHI3_CHAT_TEMPLATE, eos_token="<|endoftext|>")
    else:
        tokenizer = build_tokenizer(vocab_size)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    # Generation stops at any of these: Phi-3 ends a turn with <|end|>, a document with <|endoftext|>.
    eos_ids: int | list[int] = [tokenizer.convert_tokens_to_ids("<|end|>"), eos] if arch == "phi3" else eos
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or _round_up(8 * hidden_size // 3, 32),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
    kwargs["rope_parameters"] = rope_parameters
    if arch in ("mistral", "mixtral", "phi3"):
        kwargs["sliding_window"] = sliding_window
    elif arch == "qwen3_moe" and sliding_window is not None:
        kwargs |= dict(use_sliding_window=True, sliding_window=sliding_window)
    elif arch.startswith("gemma3"):
        kwargs.update(_gemma3_text_kwargs(num_layers, sliding_window, rope_theta, rope_scaling))
    elif sliding_window is not None:
        raise ValueError(f"sliding_window is not supported for arch {arch!r}")
    if arch == "phi3":
        # Phi3Config's own original_max_position_embeddings (4096) overrides the one given with the RoPE parameters.
        default_original = ARCHS[arch][0]().original_max_position_embeddings
        kwargs["original_max_position_embeddings"] = rope_parameters.get(
            "original_max_position_embeddings", default_original
        )
    kwargs |= ARCH_DEFAULTS.get(arch, {}) | (config_overrides or {})
    if arch == "gemma3_mm":
        config = Gemma3Config(
            text_config=Gemma3TextConfig(**kwargs), vision_config=_TINY_VISION, mm_tokens_per_image=4,
            image_token_index=vocab_size - 1,  # inside the tiny vocabulary, so refusing it is what a test sees
        )  # fmt: skip
    else:
        config = ARCHS[arch][0](**kwargs)
    config.architectures = [ARCHS[arch][1]]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch == "qwen2":
            # Qwen2 initialises biases to zero; random ones make the test cover the bias path.
            with torch.no_grad():
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0.0, init_std)
        if arch in ("qwen3", "qwen3_moe"):
            # Qwen3 initialises its per-head query/key norms to ones; random ones make the test cover them.
            with torch.no_grad():
                for layer in model.model.layers:
                    for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                        norm.weight.uniform_(0.5, 1.5)
        if arch.startswith("gemma3"):
            # Gemma initialises its (1 + w) norms to zeros; random ones make the test cover all six kinds.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight") and "vision" not in name:
                        param.uniform_(-0.5, 0.5)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos_ids, pad_token_id=pad)
    if max_shard_size is None:
        model.save_pretrained(out, safe_serialization=True)
    else:
        model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    return out
