"""``n > 1``: one prefill whose KV blocks the choices share, each choice its own seed stream, siblings
through preemption and abort, and a stream that ends after every choice."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpu_workers.engine import AsyncEngine, GuidedDecoding, SamplingParams

PROMPT = list(range(5, 5 + 37))  # two full blocks of 16 and a partial third


def count_scheduled_tokens(llm) -> list[int]:
    """Patch the scheduler to record the tokens each step computes."""
    counts: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        counts.append(batch.num_batched_tokens)
        return batch

    llm.engine.scheduler.schedule = recording
    return counts


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_choices_share_one_prefill_and_equal_seeded_singles(make_llm, model_dir, prefix_caching) -> None:
    llm = make_llm(model_dir("llama"), enable_prefix_caching=prefix_caching)
    counts = count_scheduled_tokens(llm)
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    # One prefill of the prompt, then one token per choice per step: no second prefill.
    assert sum(counts) == len(PROMPT) + 4 * (10 - 1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.choices}) == 4
    for choice in out.choices:
        single = SamplingParams(temperature=1.0, seed=7 + choice.index, max_tokens=10, ignore_eos=True, logprobs=2)
        ref = llm.generate([PROMPT], single)[0]
        assert choice.token_ids == ref.token_ids
        assert [lp.logprob for lp in choice.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)


def test_fork_shares_full_blocks_and_copies_the_partial_one(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"), enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, n=3, max_tokens=4, ignore_eos=True), request_id="r")
    engine.step()  # prefill + fork + first token of every choice
    seqs = list(engine._requests["r"])
    assert [s.index for s in seqs] == [0, 1, 2]
    shared = seqs[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in seqs)
    assert all(engine.block_manager.ref_count(b) == 3 for b in shared)
    assert len({s.block_ids[2] for s in seqs}) == 3  # the partial block: one copy per choice
    # 2 shared + 3 private partial blocks: 5 taken, not 3 x 3.
    assert engine.num_total_blocks - engine.num_free_blocks == 5
    while engine.has_unfinished():
        engine.step()
    greedy = [s.output_token_ids for s in seqs]
    assert greedy[0] == greedy[1] == greedy[2]  # greedy choices agree: the copied K/V is right
    ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert greedy[0] == ref.token_ids


def test_siblings_survive_preemption_and_a_full_pool(make_llm, model_dir) -> None:
    """A pool too small for every choice at once: siblings wait or are preempted and recomputed."""
    llm = make_llm(model_dir("llama"), num_kv_blocks=12, max_model_len=128)
    params = SamplingParams(temperature=1.0, seed=3, n=5, max_tokens=40, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.index for c in out.choices] == [0, 1, 2, 3, 4]
    for choice in out.choices:
        assert len(choice.token_ids) == 40
        single = SamplingParams(temperature=1.0, seed=3 + choice.index, max_tokens=40, ignore_eos=True)
        assert choice.token_ids == llm.generate([PROMPT], single)[0].token_ids


def test_guided_choices_each_validate(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    params = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=60, guided=GuidedDecoding(json_schema=schema))
    out = llm.generate([PROMPT], params)[0]
    assert len(out.choices) == 3
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), schema)


def test_abort_ends_every_choice(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True), request_id="before-fork")
    deltas = engine.abort("before-fork")
    assert sorted(d.index for d in deltas) == [0, 1, 2] and all(d.finish_reason == "abort" for d in deltas)
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True), request_id="after-fork")
    engine.step()
    deltas = engine.abort("after-fork")
    assert sorted(d.index for d in deltas) == [0, 1, 2] and all(d.finished for d in deltas)
    assert engine.abort("after-fork") == []


async def test_async_stream_ends_after_all_choices(make_llm, model_dir) -> None:
    llm = make_llm(model_dir("llama"))
    async with AsyncEngine(engine=llm.engine) as engine:
        params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8, ignore_eos=True)
        deltas = [d async for d in engine.generate(PROMPT, params)]
    finished = [d.index for d in deltas if d.finished]
    assert sorted(finished) == [0, 1, 2]
    for index in range(3):
        tokens = [t for d in deltas if d.index == index for t in d.token_ids]
        assert len(tokens) == 8
