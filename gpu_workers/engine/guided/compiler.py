"""Grammars compiled once per (constraint, tokenizer): xgrammar's compiler behind a small LRU cache.

xgrammar was chosen over llguidance by measured per-token mask cost on CPU (benchmarks/grammar_mask_cpu.py):
its compiled grammars precompute most of the token mask, so filling it per step costs about a microsecond.
An engine has one tokenizer, so one ``GrammarCompiler`` per engine keys the cache by the constraint alone.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from .params import GuidedDecoding

#: Compiled grammars kept per engine (a JSON schema's compiled grammar is tens of KB to a few MB).
CACHE_SIZE = 256


_ENGINE_STAMP = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)


class GrammarCompiler:
    """Compiles a ``GuidedDecoding`` for the engine's tokenizer; the same constraint compiles once."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        # ``vocab_size`` is the model head's width, which may exceed the tokenizer's (padded embeddings).
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self.num_compiled = 0

    def compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """The compiled grammar (from the cache when seen before); ``ValueError`` for a bad constraint."""
        key = guided.cache_key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            compiled = self._compile(guided)
        except (RuntimeError, ValueError, TypeError) as exc:
            # The grammar engine prefixes its own log stamp and source line ("[16:35:26] /project/cpp/x.cc:94: ");
            # the person who sent the constraint needs only what is wrong with it.
            reason = _ENGINE_STAMP.sub("", str(exc)).strip()
            raise ValueError(f"invalid {key[0]} for guided decoding: {reason}") from None
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        if guided.json_schema is not None:
            schema = guided.json_schema if isinstance(guided.json_schema, str) else json.dumps(guided.json_schema)
            return self._compile_json(schema)
        if guided.json_object:
            # OpenAI's json_object means an object.
            return self._compile_json('{"type": "object"}')
        if guided.regex is not None:
            return self._compiler.compile_regex(guided.regex)
        if guided.choice is not None:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in guided.choice)
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        assert guided.grammar is not None
        return self._compiler.compile_grammar(guided.grammar)

    def _compile_json(self, schema: str) -> xgr.CompiledGrammar:
        # No free whitespace: a weak model would otherwise pad forever instead of closing the document.
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        # xgrammar 0.2.8's length-bounded string rule (minLength/maxLength) admits raw control characters,
        # which strict JSON parsers reject; exclude them as its unbounded string rule does.
        ebnf = str(grammar).replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)
        return self._compiler.compile_grammar(ebnf)


_LOOSE_STRING_CHAR = r"([^\"\\\r\n])"
_STRICT_STRING_CHAR = r"([^\0-\x1f\"\\\r\n])"
