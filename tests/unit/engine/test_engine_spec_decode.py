"""Speculative decoding (n-gram proposer): greedy output equals non-speculative greedy token for token (with
prefix caching, chunked prefill, preemption, stops), streaming delivers several tokens per step in order,
rejection sampling keeps the target's distribution, and unsupported combinations decode without drafts."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from needs import require_import, require_triton_interpreter

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.core.sequence import Sequence
from gpu_workers.engine.execution.sampler import Sampler
from gpu_workers.engine.spec_decode import SpeculativeConfig
from gpu_workers.engine.spec_decode.ngram import NgramProposer
from gpu_workers.engine.spec_decode.rejection import verify_drafts

from .conftest import shared_prefix_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts(seed: int, count: int = 8) -> list[list[int]]:
    """Prompts that repeat a random stretch, so drafts exist from the first decode step on."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        body = [rng.randrange(3, 500) for _ in range(rng.randint(4, 60))]
        prompts.append(body + body[: rng.randint(1, len(body))])
    return prompts


def greedy(max_tokens: int = 48, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- proposer
def test_ngram_proposer_drafts_from_latest_longest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    # "5 6 7" recurs: its latest earlier occurrence (with 3 tokens after it) is followed by 9 5 6.
    assert proposer.propose([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7]) == [9, 5, 6]
    # A loop: the latest match (one token back) has one token after it; an earlier one gives a full draft.
    assert proposer.propose([4, 4, 4, 4, 4, 4]) == [4, 4, 4]
    # Only a 1-gram matches (7 -> 2); and max_tokens caps the draft.
    assert proposer.propose([7, 2, 3, 7], max_tokens=1) == [2]
    assert proposer.propose([1, 2, 3, 4]) == []
    assert proposer.propose([4]) == []


def test_speculative_config_is_checked() -> None:
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig(method="ngram", model="x")
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="must not exceed"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.from_value({"num_spec_tokens": 3})


# ---------------------------------------------------------------------------------------------- greedy parity
@pytest.mark.parametrize(
    "options",
    [
        {},
        # Chunked prefill: prompts take several steps, decodes with drafts share steps with prefill chunks.
        {"max_num_batched_tokens": 24},
        # A pool too small for the batch: sequences are preempted and recomputed mid-generation.
        {"num_kv_blocks": 32, "max_num_seqs": 8},
        {"enable_prefix_caching": False, "block_size": 8},
    ],
    ids=["plain", "chunked", "preempting", "no-prefix-cache"],
)
def test_greedy_output_equals_non_speculative(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], options: dict[str, object]
) -> None:
    path = model_dir("llama")
    prompts = repetitive_prompts(1) + [p for p, _ in shared_prefix_prompts(2)[:6]]
    base = token_ids(make_llm(path, **options), prompts, greedy())
    llm = make_llm(path, speculative_config=SPEC, **options)
    assert token_ids(llm, prompts, greedy()) == base
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0, "the workload never accepted a draft: the test checks nothing"
    assert 1.0 < stats.spec_mean_accepted_length <= 1 + SPEC["num_speculative_tokens"]
    if options.get("num_kv_blocks"):
        assert stats.num_preemptions > 0


def test_max_tokens_and_stops_cut_inside_a_draft(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    prompts = repetitive_prompts(3, count=6)
    base_llm = make_llm(path)
    full = token_ids(base_llm, prompts, greedy(40))
    # Stop on a token from the middle of each output: it must end there, as without speculation.
    stops = [greedy(40, stop_token_ids=[out[len(out) // 2]]) for out in full]
    lengths = [greedy(n) for n in (1, 2, 3, 5, 7, 11)]
    spec = make_llm(path, speculative_config=SPEC)
    assert token_ids(spec, prompts, stops) == token_ids(base_llm, prompts, stops)
    assert token_ids(spec, prompts, lengths) == [out[: p.max_tokens] for out, p in zip(full, lengths, strict=True)]
    # Text stops cut the text where the plain engine cuts it.
    texts = [o.text for o in base_llm.generate(prompts, greedy(40))]
    stop_text = [greedy(40, stop=[t[len(t) // 2 : len(t) // 2 + 2]]) if len(t) > 4 else greedy(40) for t in texts]
    assert [o.text for o in spec.generate(prompts, stop_text)] == [
        o.text for o in base_llm.generate(prompts, stop_text)
    ]
    assert spec.engine.stats().spec_num_accepted_tokens > 0


def test_streaming_delivers_accepted_tokens_in_order(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("llama"), speculative_config=SPEC)
    engine = llm.engine
    prompt = repetitive_prompts(4, count=1)[0]
    request_id = engine.add_request(prompt, greedy(60))
    streamed: list[int] = []
    sizes = []
    final = None
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == request_id
            streamed += delta.token_ids
            sizes.append(len(delta.token_ids))
            if delta.finished:
                final = delta.final
    assert final is not None and streamed == final.token_ids
    assert max(sizes) > 1, "no step delivered more than one token"
    assert token_ids(make_llm(model_dir("llama")), [prompt], greedy(60)) == [streamed]


def test_unsupported_sampling_options_decode_without_drafts(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    path = model_dir("llama")
    prompts = repetitive_prompts(5, count=3)
    params = [greedy(24, logprobs=2), greedy(24, repetition_penalty=1.2), greedy(24, min_tokens=24)]
    llm = make_llm(path, speculative_config=SPEC)
    outs = llm.generate(prompts, params)  # type: ignore[arg-type]
    assert llm.engine.stats().spec_num_drafts == 0
    base = make_llm(path).generate(prompts, params)  # type: ignore[arg-type]
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def test_min_p_requests_speculate(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    """min_p shapes each row's distribution without reading earlier positions, so its requests draft: greedy ones
    keep the plain output, sampled ones verify against the min_p-filtered target."""
    path = model_dir("llama")
    prompts = repetitive_prompts(10, count=3)
    llm = make_llm(path, speculative_config=SPEC)
    assert token_ids(llm, prompts, greedy(24, min_p=0.2)) == token_ids(make_llm(path), prompts, greedy(24))
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    sampled = SamplingParams(temperature=0.3, min_p=0.1, max_tokens=24, ignore_eos=True, seed=3)
    drafts_before = llm.engine.stats().spec_num_drafts
    assert all(len(o.token_ids) == 24 for o in llm.generate(prompts, sampled))
    assert llm.engine.stats().spec_num_drafts > drafts_before


def test_sampled_requests_speculate_and_finish(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(model_dir("llama"), speculative_config=SPEC)
    # A low temperature keeps the random model near its loops, so drafts are proposed and some accepted.
    params = SamplingParams(temperature=0.3, top_k=20, max_tokens=48, ignore_eos=True, seed=7)
    outs = llm.generate(repetitive_prompts(6), params)
    assert all(len(o.token_ids) == 48 for o in outs)
    assert llm.engine.stats().spec_num_drafts > 0


# ---------------------------------------------------------------------------------------------- rejection sampling
def _seq(params: SamplingParams) -> Sequence:
    return Sequence(
        request_id="r", prompt=None, prompt_token_ids=[1], params=params, priority=0, arrival_time=0.0,
        arrival_index=0, max_tokens=8, eos_token_ids=frozenset(), detokenizer=None,  # type: ignore[arg-type]
    )  # fmt: skip


# Chi-square critical value for 4 degrees of freedom at p = 0.001 (tables): a correct sampler fails 1 run in 1000.
CHI2_CRIT_DF4 = 18.47


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Each emitted position is distributed as the target's (temperature-scaled) distribution, whatever the
    drafts: the first token marginally, the second conditioned on the first draft accepted."""
    torch.manual_seed(0)
    vocab, k, n = 5, 2, 20000
    logits = torch.randn(k + 1, vocab) * 1.5
    params = SamplingParams(temperature=0.8)
    target = torch.softmax(logits / 0.8, dim=-1)
    sampler = Sampler(seed=123, device=torch.device("cpu"))
    seq = _seq(params)
    # The first draft is the target's second choice; the second its least likely token (mostly rejected, so the
    # residual distribution carries the position).
    drafts = [int(target[0].argsort(descending=True)[1]), int(target[1].argmin())]
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    accepted = 0
    for _ in range(n):
        result = verify_drafts(sampler, logits, seq, drafts)
        accepted += result.num_accepted
        first[result.tokens[0]] += 1
        if result.tokens[0] == drafts[0]:
            second[result.tokens[1]] += 1
    assert _chi2(first, target[0]) < CHI2_CRIT_DF4
    assert second.sum() > 500
    assert _chi2(second, target[1]) < CHI2_CRIT_DF4
    tv = 0.5 * float((first / n - target[0]).abs().sum())
    assert tv < 0.02
    # Acceptance of the first draft is p(d): the test sees the drafts matter, not just the target.
    assert abs(float(second.sum()) / n - float(target[0, drafts[0]])) < 0.02
    # The same check rejects a sampler that keeps every draft (power against the obvious bug).
    always_keep = torch.zeros(vocab)
    always_keep[drafts[0]] = n
    assert _chi2(always_keep, target[0]) > CHI2_CRIT_DF4


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 5.0
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    seq = _seq(SamplingParams(temperature=0.0))
    assert verify_drafts(sampler, logits, seq, [2, 3, 1]).tokens == [2, 3, 1, 4]
    result = verify_drafts(sampler, logits, seq, [2, 5, 1])
    assert (result.tokens, result.num_accepted) == ([2, 3], 1)
    with pytest.raises(ValueError, match="logit rows"):
        verify_drafts(sampler, logits, seq, [2])


def test_abort_and_priorities_with_speculation(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    """Two tiers share the steps (drafted decodes included) and an abort mid-generation frees its blocks; the
    requests that finish match the plain engine's greedy output."""
    path = model_dir("llama")
    prompts = repetitive_prompts(8, count=6)
    expected = token_ids(make_llm(path), prompts, greedy(40))
    llm = make_llm(path, speculative_config=SPEC, max_num_batched_tokens=64)
    engine = llm.engine
    ids = [engine.add_request(p, greedy(40), priority=i % 2) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: set[str] = set()
    victim = ids[3]
    aborted = False
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                finished.add(delta.request_id)
        if victim not in finished and len(tokens[victim]) >= 5:
            (delta,) = engine.abort(victim)
            assert delta.finished and delta.finish_reason == "abort"
            finished.add(victim)
            aborted = True
    assert aborted, "the victim finished before it could be aborted"
    for rid, want in zip(ids, expected, strict=True):
        if rid != victim:
            assert tokens[rid] == want
    assert tokens[victim] == expected[3][: len(tokens[victim])]
    assert engine.stats().spec_num_accepted_tokens > 0


def test_triton_backend_verifies_drafts_like_plain_decoding(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    """The verification pass (a multi-token query per sequence over its cached prefix) through the Triton kernels
    (interpreted on CPU: short prompts, few tokens)."""
    require_import("triton")
    from gpu_workers.engine.attention.triton_kernels import INTERPRETED

    if not torch.cuda.is_available():
        require_triton_interpreter(INTERPRETED)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = model_dir("llama")
    prompts = repetitive_prompts(9, count=2)
    options = dict(attention_backend="triton", device=device, dtype="float32", num_kv_blocks=64)
    base = token_ids(make_llm(path, **options), prompts, greedy(12))
    llm = make_llm(path, speculative_config=SPEC, **options)
    assert token_ids(llm, prompts, greedy(12)) == base
    assert llm.engine.stats().spec_num_drafts > 0
