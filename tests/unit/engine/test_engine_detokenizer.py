"""Incremental detokenization never emits half a character and adds up to the full decode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gpu_workers.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir: Callable[[str], Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir("llama")))


@pytest.mark.parametrize(
    "text",
    ["plain words and spaces", "héllo wörld — ✓ 日本語 🚀 done", "  leading spaces\nnew line\ttab", "ascii🙂"],
)
def test_deltas_add_up_and_never_split_characters(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    # Characters outside the training corpus become several byte tokens.
    assert len(ids) > len(text.split())
    detok = IncrementalDetokenizer(tokenizer, prompt, True, frozenset(tokenizer.all_special_ids))
    deltas = [detok.step(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert "".join(deltas) == text  # every character completes by the last token


def test_special_tokens_are_skipped_or_kept(tokenizer: PreTrainedTokenizerBase) -> None:
    eos = tokenizer.eos_token_id
    ids = [*tokenizer("the river", add_special_tokens=False).input_ids, eos]
    specials = frozenset(tokenizer.all_special_ids)
    skip = IncrementalDetokenizer(tokenizer, [0], True, specials)
    assert "".join(skip.step(t) for t in ids) == "the river"
    keep = IncrementalDetokenizer(tokenizer, [0], False, specials)
    assert "".join(keep.step(t) for t in ids) == "the river</s>"


def test_incomplete_character_is_flushed_at_the_end(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("日", add_special_tokens=False).input_ids
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tokenizer, [0], True, frozenset())
    assert "".join(detok.step(t) for t in ids[:-1]) == ""  # held back: not a whole character yet
    assert detok.flush() != ""
    assert detok.flush() == ""
