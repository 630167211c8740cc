"""Loads the Hugging Face tokenizer of a model folder (or of a GGUF file, through the folder converted from it)
and works out which token ids end generation."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from .models.gguf_checkpoint import converted_folder, find_gguf

log = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder or GGUF file. One without a chat template loads too (logged): such a
    model serves completions only, and chat requests are refused by name (``has_chat_template``)."""
    gguf_file = find_gguf(path)
    source = converted_folder(gguf_file) if gguf_file is not None else path
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except Exception as exc:  # missing files, unknown tokenizer class, ...: one clear message
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {exc}") from exc
    if not has_chat_template(tokenizer):
        log.info("tokenizer of %s has no chat template: completions only", path)
    return tokenizer


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether chat messages can be rendered; without a template the model is completions-only."""
    return bool(getattr(tokenizer, "chat_template", None))


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def resolve_eos_token_ids(
    model_path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer (may be several)."""
    ids: set[int] = set()
    if (model_path / "generation_config.json").is_file():
        ids = _as_id_set(GenerationConfig.from_pretrained(str(model_path)).eos_token_id)
    if not ids:
        ids = _as_id_set(getattr(hf_config, "eos_token_id", None))
    if not ids:
        ids = _as_id_set(tokenizer.eos_token_id)
    return frozenset(ids)
