"""Loads the Hugging Face tokenizer of a model folder and works out which token ids end generation."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # missing files, unknown tokenizer class, ...: one clear message
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {exc}") from exc


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
