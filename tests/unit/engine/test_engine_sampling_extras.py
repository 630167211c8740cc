"""Penalties, logit_bias, min_p and logprobs checked against references computed from transformers logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_workers.engine import SamplingParams

PROMPT = [5, 17, 99, 17, 250, 3, 41, 41, 300, 7]


@pytest.fixture(scope="module")
def hf_llama(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir("llama")), dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def reference_greedy(model, prompt: list[int], steps: int, params: SamplingParams) -> list[int]:
    """Greedy decoding with penalties applied token by token in plain Python (an independent rewrite)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(steps):
        logits = hf_logits(model, ids).clone()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        for token in set(ids):
            value = logits[token].item()
            logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token) + params.presence_penalty
        nxt = int(logits.argmax())
        ids.append(nxt)
        out.append(nxt)
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.7),
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(logit_bias={10: 4.0, 11: -100.0}),
        dict(presence_penalty=-0.5, frequency_penalty=1.0, repetition_penalty=1.3, logit_bias={20: 3.0}),
    ],
)
def test_penalties_match_reference(make_llm, model_dir, hf_llama, penalties) -> None:
    llm = make_llm(model_dir("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalties)
    plain_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm.generate([PROMPT], plain_params)[0].token_ids
    # Batched with a plain request: the penalties stay on their own row.
    got, other = llm.generate([PROMPT, PROMPT], [params, plain_params])
    assert got.token_ids == reference_greedy(hf_llama, PROMPT, 24, params)
    assert other.token_ids == plain
    assert got.token_ids != plain, "the penalty changed nothing: the test would not catch a broken one"


def test_logprobs_are_raw_log_softmax(make_llm, model_dir, hf_llama) -> None:
    llm = make_llm(model_dir("llama"))
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=5, presence_penalty=1.0)
    out = llm.generate([PROMPT], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
    ids = list(PROMPT)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        ref = torch.log_softmax(hf_logits(hf_llama, ids), dim=-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
        top_values, top_ids = ref.topk(5)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        ids.append(token)


def test_logprobs_zero_gives_chosen_only_and_streams_align(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0))[0]
    assert out.logprobs is not None and all(lp.top == [] for lp in out.logprobs)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert plain.logprobs is None


def test_min_p_keeps_only_tokens_near_the_top(make_llm, model_dir, hf_llama) -> None:
    """With min_p = 1 only the top token survives, so sampling equals greedy whatever the seed."""
    llm = make_llm(model_dir("llama"))
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].token_ids
    for seed in range(3):
        params = SamplingParams(temperature=1.5, min_p=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].token_ids == greedy
    free = SamplingParams(temperature=1.5, seed=0, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPT], free)[0].token_ids != greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty="x"), "frequency_penalty must be a number"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(min_p=1.5), "min_p must be in [0, 1]"),
        (dict(logit_bias={"a": 1}), "logit_bias keys must be non-negative token ids"),
        (dict(logit_bias={3: 101}), "logit_bias[3] must be in [-100, 100]"),
        (dict(logprobs=21), "logprobs must be in [0, 20]"),
        (dict(logprobs=True), "logprobs must be an int or None"),
        (dict(n=0), "n must be an int >= 1"),
        (dict(guided="json"), "guided must be a GuidedDecoding"),
    ],
)
def test_validation_errors_are_clear(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_out_of_vocabulary_bias_is_refused_at_admission(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    with pytest.raises(ValueError, match=r"token ids out of range \[0, 512\) in logit_bias"):
        llm.generate([PROMPT], SamplingParams(logit_bias={512: 1.0}))
