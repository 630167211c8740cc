"""Guided output is valid UTF-8 and valid against the schema as a client decodes it: the UTF-8 DFA against
Python's strict decoder, token bytes against xgrammar's, and sampled json_schema output from a random model."""

from __future__ import annotations

import codecs
import itertools
import json
import random

import jsonschema
import xgrammar as xgr

from gpu_workers.engine import GuidedDecoding, SamplingParams
from gpu_workers.engine.guided.utf8_mask import ACCEPT, ERROR, run
from gpu_workers.engine.token_bytes import vocab_bytes

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 20}, "t": {"type": "string", "maxLength": 5}},
    "required": ["s", "t"],
    "additionalProperties": False,
}


_TAILS = [bytes(t) for n in (1, 2, 3) for t in itertools.product((0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF), repeat=n)]


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _valid_prefix(data: bytes) -> bool:
    """Whether some continuation makes ``data`` strict UTF-8 (Python's decoder as the reference)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return _decodes(data) or any(_decodes(data + tail) for tail in _TAILS)


def test_dfa_agrees_with_pythons_strict_decoder() -> None:
    rng = random.Random(0)
    cases = [bytes(p) for p in itertools.product(range(256), repeat=2)]
    interesting = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC,
                   0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]  # fmt: skip
    cases += [bytes(rng.choice(interesting) for _ in range(rng.randint(1, 9))) for _ in range(30000)]
    for data in cases:
        state = run(ACCEPT, data)
        assert (state != ERROR) == _valid_prefix(data), data.hex()
        if state == ACCEPT:
            data.decode("utf-8")  # a complete sequence decodes strictly


def test_surrogates_overlongs_and_out_of_range_are_refused() -> None:
    bad_sequences = (
        b"\xed\xa0\x80",
        b"\xc0\x80",
        b"\xe0\x80\x80",
        b"\xf0\x80\x80\x80",
        b"\xf4\x90\x80\x80",
        b"\xf5",
        b"\x80",
    )
    for bad in bad_sequences:
        assert run(ACCEPT, bad) == ERROR, bad.hex()
    for good in ("é", "€", "\ud7ff", "\ue000", "😀", "\U0010ffff"):
        assert run(ACCEPT, good.encode()) == ACCEPT


def test_token_bytes_match_xgrammars_decoded_vocabulary(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    tokenizer = llm.engine.tokenizer
    ours = vocab_bytes(tokenizer)
    theirs = xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab
    special = {int(i) for i in tokenizer.added_tokens_decoder}
    differ = [i for i in range(len(ours)) if i not in special and ours[i] != theirs[i]]
    assert not differ, [(i, ours[i], theirs[i]) for i in differ[:5]]
    assert sum(1 for b in ours if len(b) == 1 and b[0] >= 0x80) == 128  # every high byte is a token


def test_sampled_json_schema_output_is_valid_utf8_and_valid_against_the_schema(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    guided = GuidedDecoding(json_schema=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=150, guided=guided) for seed in range(48)]
    outs = llm.generate([[5, 17, 99, 250, 3, 41]] * len(params), params)
    table, eos = vocab_bytes(llm.engine.tokenizer), llm.engine.eos_token_ids
    non_ascii = 0
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert "\ufffd" not in out.text, out.text
        raw = b"".join(table[t] for t in out.token_ids if t not in eos)
        assert raw.decode("utf-8") == out.text  # strict: the bytes are valid UTF-8
        jsonschema.validate(json.loads(out.text), SCHEMA)
        non_ascii += not out.text.isascii()
    assert non_ascii, "no sampled output held a multi-byte character: the test would not see the bug"
