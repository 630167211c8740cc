"""Writes a small random-weight Llama/Mistral/Qwen2/Qwen3 checkpoint plus a trained byte-level BPE
tokenizer as an ordinary Hugging Face folder, for tests, demos and benchmarks without downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

# Each ``arch``: transformers' config class and the ``architectures`` name its checkpoints carry.
ARCHS: dict[str, tuple[type, str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the built-in corpus, padded to exactly ``vocab_size``.

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
        special_tokens=SPECIAL_TOKENS,
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
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
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
) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``generation_config.json`` and tokenizer files
    for a random model into ``out_dir`` (created if needed) and return its path.

    ``init_std`` is larger than the usual 0.02 so greedy decoding produces varied tokens rather
    than one token forever. ``intermediate_size`` defaults to ~8/3 x hidden, rounded up to 32.
    ``max_shard_size`` (e.g. ``"200KB"``) splits the weights into an indexed, sharded checkpoint.
    ``head_dim`` defaults to ``hidden_size // num_heads`` (Qwen3 and Gemma set it apart from the hidden size).
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
    tokenizer = build_tokenizer(vocab_size)
    bos, eos, pad = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
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
    if arch == "mistral":
        kwargs["sliding_window"] = None
    config_class, architecture = ARCHS[arch]
    config = config_class(**kwargs)
    config.architectures = [architecture]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch == "qwen2":
            # Qwen2 initialises biases to zero; random ones make the test cover the bias path.
            with torch.no_grad():
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0.0, init_std)
        if arch == "qwen3":
            # Qwen3 initialises its per-head query/key norms to ones; random ones make the test cover them.
            with torch.no_grad():
                for layer in model.model.layers:
                    for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                        norm.weight.uniform_(0.5, 1.5)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if max_shard_size is None:
        model.save_pretrained(out, safe_serialization=True)
    else:
        model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    return out
