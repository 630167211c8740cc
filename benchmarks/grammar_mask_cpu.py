"""Per-token grammar mask cost on CPU: xgrammar vs llguidance, same JSON schema, same tokenizers.

For each library and tokenizer (the tiny test model's 512-token byte-level BPE and a 32000-token one,
both built by ``make_tiny_model``'s tokenizer trainer, no downloads) it compiles the schema once, then
walks a valid document token by token: fill the next-token bitmask, accept the token. The per-token
cost is the mean of (fill + accept) over the document, best of ``--repeats`` walks. This is what picks
the library the engine uses (docs/benchmarks.md). Usage: ``python benchmarks/grammar_mask_cpu.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt, markdown_table
from gpu_workers.engine.models.random_checkpoint import build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "engines", "poetry", "notes"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "active": True,
}


def walk_xgrammar(tokenizer, vocab: int, tokens: list[int], repeats: int) -> tuple[float, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    best = float("inf")
    for _ in range(repeats):
        matcher = xgr.GrammarMatcher(compiled)
        start = time.perf_counter()
        for tok in tokens:
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(tok), tok
        best = min(best, (time.perf_counter() - start) / len(tokens))
    return best, compile_s


def walk_llguidance(tokenizer, vocab: int, tokens: list[int], repeats: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    llguidance.LLMatcher(lltok, grammar)  # compile (validates) once
    compile_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    best = float("inf")
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(lltok, grammar)
        start = time.perf_counter()
        for tok in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(tok), (tok, matcher.get_error())
        best = min(best, (time.perf_counter() - start) / len(tokens))
    return best, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    text = json.dumps(DOCUMENT)
    rows = []
    for vocab in (512, 32000):
        tokenizer = build_tokenizer(vocab)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for name, walk in (("xgrammar", walk_xgrammar), ("llguidance", walk_llguidance)):
            per_token, compile_s = walk(tokenizer, vocab, tokens, args.repeats)
            rows.append([name, str(vocab), str(len(tokens)), fmt(per_token * 1e6, 1), fmt(compile_s * 1e3, 1)])
    print(markdown_table(["library", "vocab", "doc tokens", "mask+accept per token (us)", "compile (ms)"], rows))


if __name__ == "__main__":
    main()
