"""Incremental detokenization: turn one new token at a time into the text it adds.

Decoding a lone token is wrong for byte-level and sentencepiece vocabularies (leading spaces,
characters split over several tokens), so each step decodes a short window of recent tokens
twice - up to ``read_offset`` and up to the new token - and emits the difference. Text ending in
U+FFFD (an unfinished multi-byte character) is held back until a later token completes it, or
until the request ends (``flush``).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens of prompt context decoded along with the first output token (leading-space handling).
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        special_ids: frozenset[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = special_ids
        context = prompt_token_ids[-(_INITIAL_CONTEXT + 2) :]
        if skip_special_tokens:
            context = [t for t in context if t not in special_ids]
        self.tokens: list[str] = self._to_tokens(context)
        self.prefix_offset = max(len(self.tokens) - _INITIAL_CONTEXT, 0)
        self.read_offset = len(self.tokens)

    def _to_tokens(self, ids: list[int]) -> list[str]:
        # Ids past the tokenizer's vocabulary (model vocab padded beyond it) decode to nothing.
        return [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def step(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        if self.skip_special_tokens and token_id in self.special_ids:
            return ""
        self.tokens.extend(self._to_tokens([token_id]))
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        # Only the window from prefix_offset on is ever decoded again; drop older tokens.
        if self.prefix_offset > 64:
            del self.tokens[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a request, release held-back text even if it ends mid-character."""
        if self.read_offset >= len(self.tokens):
            return ""
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = to_string(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :]
