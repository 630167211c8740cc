"""Speculative decoding with a draft model: greedy output equals non-speculative greedy token for token (a random
draft that is rarely right, and a draft with the target's weights that is always right; with chunked prefill,
preemption and abort), the draft's own KV cache is given back, a draft of another vocabulary is refused, and
rejection sampling with the draft's full distribution q keeps the target's distribution (min_p included)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.execution.sampler import Sampler
from gpu_workers.engine.models.random_checkpoint import make_tiny_model
from gpu_workers.engine.spec_decode.rejection import verify_drafts

from .test_engine_spec_decode import CHI2_CRIT_DF4, _chi2, _seq, greedy, repetitive_prompts, token_ids

K = 3


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random draft half the target's width with one layer: the same tokenizer, other weights."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "small", num_layers=1, hidden_size=32, seed=11)


def spec(draft: Path) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


def assert_draft_pool_whole(llm: LLM) -> None:
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.draft_model is not None
    draft = speculator.draft_model
    assert not draft.states and draft.num_free_blocks == draft.pool.num_blocks, "draft KV blocks leaked"


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 24}, {"num_kv_blocks": 16, "max_num_seqs": 8, "max_model_len": 256}],
    ids=["plain", "chunked", "preempting"],
)
def test_draft_with_the_targets_weights_is_accepted_and_exact(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], options: dict[str, object]
) -> None:
    path = model_dir("llama")
    prompts = repetitive_prompts(11, count=6)
    base = token_ids(make_llm(path, **options), prompts, greedy(32))
    llm = make_llm(path, speculative_config=spec(path), **options)
    assert token_ids(llm, prompts, greedy(32)) == base
    stats = llm.engine.stats()
    # The draft computes what the target computes: every draft is accepted (float noise aside).
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    if options.get("num_kv_blocks"):
        assert stats.num_preemptions > 0
    assert_draft_pool_whole(llm)


def test_random_draft_is_rarely_right_and_still_exact(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM], small_draft: Path
) -> None:
    path = model_dir("llama")
    prompts = repetitive_prompts(12, count=6)
    base = token_ids(make_llm(path), prompts, greedy(32))
    llm = make_llm(path, speculative_config=spec(small_draft))
    assert token_ids(llm, prompts, greedy(32)) == base
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert_draft_pool_whole(llm)


def test_abort_and_sampling_with_a_draft_model(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> None:
    """An abort mid-generation gives the draft's blocks back; sampled requests (seeded, min_p) draft from q and
    finish; the others keep the plain greedy output."""
    path = model_dir("llama")
    prompts = repetitive_prompts(13, count=4)
    expected = token_ids(make_llm(path), prompts, greedy(30))
    llm = make_llm(path, speculative_config=spec(path), max_num_batched_tokens=64)
    engine = llm.engine
    ids = [engine.add_request(p, greedy(30), priority=i % 2) for i, p in enumerate(prompts)]
    sampled = engine.add_request(
        prompts[0], SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=30, ignore_eos=True)
    )
    tokens: dict[str, list[int]] = {rid: [] for rid in [*ids, sampled]}
    victim, aborted = ids[2], False
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        if not aborted and len(tokens[victim]) >= 4:
            (delta,) = engine.abort(victim)
            assert delta.finished and delta.finish_reason == "abort"
            aborted = True
    assert aborted
    for rid, want in zip(ids, expected, strict=True):
        assert tokens[rid] == (want[: len(tokens[rid])] if rid == victim else want)
    assert len(tokens[sampled]) == 30
    assert engine.stats().spec_num_accepted_tokens > 0
    assert_draft_pool_whole(llm)


def test_draft_of_another_vocabulary_is_refused(tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    target = str(model_dir("llama"))
    wider = make_tiny_model(tmp_path / "wider", num_layers=1, hidden_size=32, vocab_size=640)
    with pytest.raises(ValueError, match="vocabulary of 640 tokens, the target 512"):
        LLM(target, max_model_len=256, num_kv_blocks=64, speculative_config=spec(wider))
    # Same size, two token ids swapped: the ids no longer mean the same text.
    swapped = make_tiny_model(tmp_path / "swapped", num_layers=1, hidden_size=32)
    tokenizer_file = swapped / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(target, max_model_len=256, num_kv_blocks=64, speculative_config=spec(swapped))


@pytest.mark.parametrize("min_p", [0.0, 0.15], ids=["plain", "min_p"])
def test_rejection_with_the_drafts_distribution_keeps_the_target_distribution(min_p: float) -> None:
    """Drafts drawn from a q unlike p: each emitted position is distributed as the target's (temperature and
    min_p applied), and a draft is kept with probability min(1, p/q), so acceptance is sum min(p, q)."""
    torch.manual_seed(1)
    vocab, k, n = 5, 2, 8000
    logits = torch.randn(k + 1, vocab) * 1.5
    seq = _seq(SamplingParams(temperature=0.8, min_p=min_p))
    target = Sampler.target_probs(logits, [seq] * (k + 1))
    q = torch.softmax(torch.randn(k, vocab), dim=-1)
    sampler = Sampler(seed=321, device=torch.device("cpu"))
    draw = torch.Generator().manual_seed(5)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=draw).flatten().tolist()
        result = verify_drafts(sampler, logits, seq, drafts, q)
        first[result.tokens[0]] += 1
        if result.num_accepted >= 1:
            second[result.tokens[1]] += 1
    # Tokens min_p removes have probability 0 and never occur; the rest is a chi-square over <= 4 dof.
    for counts, probs in ((first, target[0]), (second, target[1])):
        support = probs > 0
        assert int(counts[~support].sum()) == 0
        assert _chi2(counts[support], probs[support]) < CHI2_CRIT_DF4
    acceptance = float(torch.minimum(target[0], q[0]).sum())
    assert abs(float(second.sum()) / n - acceptance) < 0.02
    # Power: a verifier that kept the min(1, p/q) rule but redrew a rejection from p itself (not from
    # max(p - q, 0)) emits min(p, q) + (1 - acceptance) p; the same test refuses that distribution.
    wrong = torch.minimum(target[0], q[0]) + (1 - acceptance) * target[0]
    wrong_counts = torch.bincount(torch.multinomial(wrong, n, replacement=True, generator=draw), minlength=vocab)
    support = target[0] > 0
    assert _chi2(wrong_counts[support].float(), target[0][support]) > CHI2_CRIT_DF4


def test_shape_of_the_drafts_distribution_is_checked() -> None:
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    seq = _seq(SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="draft probabilities"):
        verify_drafts(sampler, torch.zeros(3, 5), seq, [1, 2], torch.full((1, 5), 0.2))
