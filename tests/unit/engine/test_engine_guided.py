"""Guided decoding: valid output from a random-weight model, greedy equals greedy over the allowed tokens
(reference: transformers logits masked step by step with the same grammar), replay, caching, errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM

from gpu_workers.engine import GuidedDecoding, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 99, 250, 3, 41]


def test_json_schema_output_validates_from_a_random_model(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, guided=GuidedDecoding(json_schema=SCHEMA))
        for seed in range(6)
    ]
    # Batched with unguided requests: the mask stays on the guided rows.
    params += [SamplingParams(temperature=1.0, seed=9, max_tokens=20)]
    outs = llm.generate([PROMPT] * len(params), params)
    for out in outs[:-1]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.sequences.grammar_compiler.num_compiled == 1  # compiled once, reused by every request


def test_regex_choice_and_json_object(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    for seed in range(4):
        regex = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=30, guided=GuidedDecoding(regex=r"[a-c]{3}-\d{2}")
        )
        choice = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, guided=GuidedDecoding(choice=["yes", "no"]))
        obj = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, guided=GuidedDecoding(json_object=True))
        r, c, o = llm.generate([PROMPT] * 3, [regex, choice, obj])
        assert re.fullmatch(r"[a-c]{3}-\d{2}", r.text), r.text
        assert c.text in ("yes", "no")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            # A random model at temperature 1 may wander inside a string past max_tokens: what it wrote must
            # still be a prefix the grammar accepts, token by token.
            assert o.finish_reason == "length", o.finish_reason
            matcher = xgr.GrammarMatcher(llm.engine.sequences.grammar_compiler.compile(obj.guided))
            assert all(matcher.accept_token(t) for t in o.token_ids), o.text
            assert o.text.startswith("{"), o.text


def test_greedy_with_grammar_equals_greedy_over_allowed_tokens(make_llm, model_dir) -> None:
    path = model_dir("llama")
    llm = make_llm(path)
    guided = GuidedDecoding(json_schema=SCHEMA)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=120, guided=guided))[0]
    # Reference: transformers logits, masked by a matcher of the same compiled grammar, argmax.
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    compiler = llm.engine.sequences.grammar_compiler
    matcher = xgr.GrammarMatcher(compiler.compile(guided))
    vocab = compiler.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, expected = list(PROMPT), []
    while not matcher.is_terminated() and len(expected) < 120:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        token = allowed[int(logits[allowed].argmax())]
        assert matcher.accept_token(token)
        ids.append(token)
        expected.append(token)
    assert out.token_ids == expected
    unguided = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=len(expected)))[0]
    assert unguided.token_ids != expected, "the grammar changed nothing: the test would not catch a broken mask"


def test_replay_resumes_a_valid_document(make_llm, model_dir) -> None:
    """A crash after k tokens: prompt + delivered tokens as the prompt, delivered tokens replayed into the
    grammar; the joined output is still valid (and, greedy, the same as the uninterrupted run)."""
    llm = make_llm(model_dir("llama"))
    full = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=200, guided=GuidedDecoding(json_schema=SCHEMA))
    )[0]
    delivered = full.token_ids[:7]
    resumed = llm.generate(
        [PROMPT + delivered],
        SamplingParams(
            temperature=0.0, max_tokens=200, guided=GuidedDecoding(json_schema=SCHEMA, replay_token_ids=delivered)
        ),
    )[0]
    assert delivered + resumed.token_ids == full.token_ids
    jsonschema.validate(
        json.loads(llm.tokenizer.decode(delivered + resumed.token_ids, skip_special_tokens=True)), SCHEMA
    )


def test_bad_constraints_and_replays_are_refused(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    with pytest.raises(ValueError, match="invalid regex for guided decoding") as refused:
        llm.generate([PROMPT], SamplingParams(guided=GuidedDecoding(regex="(unclosed")))
    # The grammar engine's log stamp and C++ source line are not part of what the sender reads.
    assert ".cc:" not in str(refused.value) and "[" not in str(refused.value).split(":", 1)[1][:3]
    with pytest.raises(ValueError, match="replay_token_ids\\[0\\]"):
        bad = llm.tokenizer.encode("zzz", add_special_tokens=False)
        llm.generate([PROMPT], SamplingParams(guided=GuidedDecoding(json_schema=SCHEMA, replay_token_ids=bad)))
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecoding(regex="a", json_object=True)
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        GuidedDecoding(json_schema="{nope")


def test_ebnf_grammar(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    grammar = GuidedDecoding(grammar='root ::= "id-" [0-9] [0-9]? ("!" | "?")')
    for seed in range(3):
        out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=seed, max_tokens=20, guided=grammar))[0]
        assert re.fullmatch(r"id-[0-9]{1,2}[!?]", out.text), out.text
