"""Sampling and stopping: seeds, top-k/top-p, stop strings, stop ids, EOS, max/min tokens, and
rejection of invalid parameters and impossible requests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpu_workers.engine import LLM, SamplingParams

from .conftest import random_prompts

PROMPTS = [p for p, _ in random_prompts(seed=7)[2:8]]


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture
def llm(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(model_dir("llama"))


def test_seeded_sampling_repeats_and_ignores_batch_company(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params)[0].token_ids
    again = llm.generate(PROMPTS[0], params)[0].token_ids
    assert first == again
    # Same seed inside a mixed batch (other rows greedy or unseeded) gives the same tokens.
    mixed = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [_greedy(24), params, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)],
    )
    assert mixed[1].token_ids == first
    other = llm.generate(PROMPTS[0], SamplingParams(temperature=0.9, max_tokens=24, seed=99, ignore_eos=True))
    assert other[0].token_ids != first


def test_engine_seed_makes_unseeded_sampling_reproducible(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = [[o.token_ids for o in make_llm(model_dir("llama"), seed=5).generate(PROMPTS, params)] for _ in range(2)]
    assert runs[0] == runs[1]
    greedy = [o.token_ids for o in make_llm(model_dir("llama"), seed=5).generate(PROMPTS, _greedy(16))]
    assert runs[0] != greedy


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    greedy = [o.token_ids for o in llm.generate(PROMPTS, _greedy(20))]
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in top1] == greedy


def test_tiny_top_p_equals_greedy(llm: LLM) -> None:
    greedy = [o.token_ids for o in llm.generate(PROMPTS, _greedy(20))]
    nucleus = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in nucleus] == greedy


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, [_greedy(n) for n in (1, 2, 5, 9, 17, 33)])
    assert [len(o.token_ids) for o in outs] == [1, 2, 5, 9, 17, 33]
    assert all(o.finish_reason == "length" and o.stop_reason is None for o in outs)
    metrics = outs[0].metrics
    assert metrics.num_prompt_tokens == len(PROMPTS[0]) and metrics.num_output_tokens == 1
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finish_time


def test_stop_string_cuts_text_exactly(llm: LLM) -> None:
    full = llm.generate(PROMPTS[3], _greedy(40))[0]
    text = full.text
    # A stop string from the middle of the greedy text (at least 2 chars, first occurrence).
    stop = next(text[i : i + 3] for i in range(len(text) // 3, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    cut = text.index(stop)
    out = llm.generate(PROMPTS[3], _greedy(40, stop=["never-appears", stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    full = llm.generate(PROMPTS[4], _greedy(30))[0].token_ids
    stop_id = full[6]
    first = full.index(stop_id)
    out = llm.generate(PROMPTS[4], _greedy(30, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full[: first + 1]  # the stop token is kept in token_ids
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # EOS comes from generation_config.json; pretend the model's EOS is that token.
    engine = llm.engine
    assert engine.eos_token_ids == frozenset({llm.tokenizer.convert_tokens_to_ids("</s>")})
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({stop_id})
    try:
        eos_out = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=30))[0]
        ignored = llm.generate(PROMPTS[4], _greedy(30))[0]
    finally:
        engine.eos_token_ids = saved
    assert eos_out.token_ids == full[: first + 1]
    assert eos_out.finish_reason == "stop" and eos_out.stop_reason is None
    assert ignored.token_ids == full


def test_min_tokens_defers_stop_ids(llm: LLM) -> None:
    full = llm.generate(PROMPTS[4], _greedy(30))[0].token_ids
    stop_id = full[0]
    out = llm.generate(PROMPTS[4], _greedy(30, stop_token_ids=[stop_id], min_tokens=4))[0]
    assert len(out.token_ids) >= 4
    assert stop_id not in out.token_ids[:4]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"top_k": 2.5},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 2},
        {"stop": [""]},
        {"stop": [1, 2]},
        {"stop_token_ids": [-1]},
        {"seed": "seven"},
    ],
)
def test_invalid_sampling_params_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_impossible_requests_are_rejected_and_leave_the_engine_clean(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate([1] * 500, _greedy(100))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], _greedy(4))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([5, 100000], _greedy(4))
    with pytest.raises(ValueError, match="priority"):
        llm.generate([5, 6], _greedy(4), priority="urgent")
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(PROMPTS[:2], [_greedy(4)])
    # A bad request in a list means none of the list is queued.
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], [1] * 600], _greedy(4))
    assert not llm.engine.has_unfinished()


def test_text_prompt_and_special_tokens(llm: LLM) -> None:
    out = llm.generate("The cache keeps the keys", _greedy(8))[0]
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert len(out.token_ids) == 8
    single = llm.generate([PROMPTS[0]], _greedy(3))
    assert len(single) == 1 and single[0].prompt_token_ids == PROMPTS[0]
