"""Multi-LoRA in the engine: greedy outputs equal transformers with the adapter merged by ``peft``, for batches that
mix adapters of several ranks and the base model, under every scheduling regime the engine has (chunked prefill,
preemption, forks, speculative decoding), with slots and the CPU pool evicting; prefix caching keyed by adapter."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, EngineConfig, LoRAError, LoRARequest, SamplingParams

from .lora_adapters import MergedReference, make_adapter

Adapters = dict[int, Path]


@pytest.fixture(scope="module")
def adapters(model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapters]:
    """Per base variant, four adapters: ranks 4, 8 and 16 on every projection, and rank 2 on q/v only."""
    root = tmp_path_factory.mktemp("lora_adapters")
    made: dict[str, Adapters] = {}
    for variant in ("llama", "qwen2", "qwen3"):
        base = model_dir(variant)
        made[variant] = {r: make_adapter(base, root / f"{variant}-r{r}", r, seed=r) for r in (4, 8, 16)}
        made[variant][2] = make_adapter(base, root / f"{variant}-r2", 2, targets=["q_proj", "v_proj"], seed=2)
    return made


@pytest.fixture(scope="module")
def references(model_dir: Callable[[str], Path]) -> Callable[[str], MergedReference]:
    built: dict[str, MergedReference] = {}

    def get(variant: str) -> MergedReference:
        if variant not in built:
            built[variant] = MergedReference(model_dir(variant))
        return built[variant]

    return get


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _lora(adapters: Adapters, rank: int) -> LoRARequest:
    return LoRARequest(f"r{rank}", rank, str(adapters[rank]))


def _check(llm: LLM, ref: MergedReference, prompts: list[list[int]], loras: list[LoRARequest | None],
           max_tokens: int = 8, **params: object) -> None:  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params),
                           lora_request=loras)  # fmt: skip
    for i, (out, prompt, lora) in enumerate(zip(outputs, prompts, loras, strict=True)):
        expected = ref.greedy(Path(lora.lora_path) if lora else None, prompt, max_tokens)
        name = lora.lora_name if lora else "base"
        for choice in out.choices or [out]:
            assert choice.token_ids == expected, f"prompt {i} ({len(prompt)} tokens, {name}) diverged"


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_equals_merged_peft(
    variant: str, adapters: dict[str, Adapters], references: Callable[[str], MergedReference],
    make_llm: Callable[..., LLM],
) -> None:  # fmt: skip
    ads, ref = adapters[variant], references(variant)
    prompts = _prompts(1, (5, 17, 33, 9, 20, 40, 3, 12, 16, 30))
    loras = [_lora(ads, r) if r else None for r in (4, 8, 16, None, 4, None, 16, 8, 2, 2)]
    llm = make_llm(ref.base, enable_lora=True)
    _check(llm, ref, prompts, loras)
    # The adapters matter: each one's output differs from the base model's on some prompt.
    for rank in (4, 8, 16, 2):
        assert any(ref.greedy(ads[rank], p, 8) != ref.greedy(None, p, 8) for p in prompts[:4]), f"r{rank} is a no-op"
    assert sorted(r.lora_int_id for r in llm.list_loras()) == [2, 4, 8, 16]


def test_chunked_prefill_preemption_and_forks(
    adapters: dict[str, Adapters], references: Callable[[str], MergedReference], make_llm: Callable[..., LLM]
) -> None:
    ads, ref = adapters["llama"], references("llama")
    prompts = _prompts(2, (70, 45, 33, 90, 20, 64))
    loras = [_lora(ads, r) if r else None for r in (4, 16, None, 8, 16, 4)]
    # A tiny cache forces preemption (adapters released, re-acquired), a small budget chunks every prefill.
    llm = make_llm(
        ref.base, enable_lora=True, max_model_len=128, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=4
    )
    _check(llm, ref, prompts, loras, max_tokens=12)
    assert llm.engine.scheduler.num_preemptions > 0
    # n = 2: the fork decodes with its parent's adapter.
    _check(llm, ref, prompts[:3], loras[:3], n=2)


def test_more_adapters_than_slots(
    adapters: dict[str, Adapters], references: Callable[[str], MergedReference], make_llm: Callable[..., LLM]
) -> None:
    ads, ref = adapters["llama"], references("llama")
    prompts = _prompts(3, (12, 30, 7, 19, 25, 11, 40, 8))
    loras = [_lora(ads, r) if r else None for r in (4, 8, 16, 2, None, 16, 4, 8)]
    llm = make_llm(ref.base, enable_lora=True, max_loras=2)
    _check(llm, ref, prompts, loras)
    slots = llm.engine.lora.slots
    assert slots.num_loads >= 4, "four adapters went through two slots"
    assert len(slots.resident) == 2


def test_cpu_pool_evicts_least_recently_used(
    adapters: dict[str, Adapters], references: Callable[[str], MergedReference], make_llm: Callable[..., LLM]
) -> None:
    ads, ref = adapters["llama"], references("llama")
    llm = make_llm(ref.base, enable_lora=True, max_loras=1, max_cpu_loras=2)
    r4, r8, r16 = (_lora(ads, r) for r in (4, 8, 16))
    assert llm.add_lora(r4) and llm.add_lora(r8)
    assert not llm.add_lora(r4)  # already loaded: it becomes the most recently used
    assert llm.add_lora(r16)  # evicts r8, the least recently used
    assert [r.lora_int_id for r in llm.list_loras()] == [4, 16]
    # An evicted adapter is loaded again on demand.
    prompts = _prompts(4, (10, 21))
    _check(llm, ref, prompts, [r8, r8])
    assert {r.lora_int_id for r in llm.list_loras()} == {8, 16}
    assert llm.engine.lora.num_cpu_loads == 4
    assert llm.remove_lora(8) and not llm.remove_lora(8) and not llm.remove_lora(99)
    assert [r.lora_int_id for r in llm.list_loras()] == [16]
    assert llm.engine.lora.resident == []  # r8 held the only slot; removing it freed the slot


def test_prefix_cache_is_keyed_by_adapter(
    adapters: dict[str, Adapters], references: Callable[[str], MergedReference], make_llm: Callable[..., LLM]
) -> None:
    ads, ref = adapters["llama"], references("llama")
    llm = make_llm(ref.base, enable_lora=True)
    prompt = _prompts(5, (50,))[0]
    first: dict[str, int] = {}
    for lora in (_lora(ads, 4), _lora(ads, 8), None):
        out = llm.generate([prompt], _greedy(), lora_request=lora)[0]
        assert out.token_ids == ref.greedy(Path(lora.lora_path) if lora else None, prompt, 8)
        first[lora.lora_name if lora else "base"] = out.metrics.num_cached_tokens
    # The same prompt under another adapter (or none) never reuses K/V computed under the first.
    assert first == {"r4": 0, "r8": 0, "base": 0}
    for lora in (_lora(ads, 8), _lora(ads, 4), None):
        out = llm.generate([prompt], _greedy(), lora_request=lora)[0]
        assert out.token_ids == ref.greedy(Path(lora.lora_path) if lora else None, prompt, 8)
        assert out.metrics.num_cached_tokens == 48  # three full blocks of its own adapter's earlier run


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters(
    method: str, adapters: dict[str, Adapters], references: Callable[[str], MergedReference],
    make_llm: Callable[..., LLM],
) -> None:  # fmt: skip
    ads, ref = adapters["llama"], references("llama")
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        # The draft is the base model without the adapters: the target (with them) verifies, so outputs stay exact.
        spec = {"method": "draft_model", "model": str(ref.base), "num_speculative_tokens": 3}
    llm = make_llm(ref.base, enable_lora=True, speculative_config=spec)
    rng = random.Random(6)
    # Repetitive prompts, so the n-gram proposer drafts and the adapters' verification decides.
    prompts = [[rng.randrange(3, 40) for _ in range(n)] * 3 for n in (6, 9, 5)]
    _check(llm, ref, prompts, [_lora(ads, 4), None, _lora(ads, 16)], max_tokens=16)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    if method == "draft_model":  # the base prompt's drafts are the target's own tokens: accepted
        assert stats.spec_num_accepted_tokens > 0


def test_refusals(adapters: dict[str, Adapters], model_dir: Callable[[str], Path], make_llm: Callable[..., LLM],
                  tmp_path: Path) -> None:  # fmt: skip
    ads, base = adapters["llama"], model_dir("llama")
    plain = make_llm(base)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[5, 6, 7]], _greedy(), lora_request=_lora(ads, 4))
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.add_lora(_lora(ads, 4))
    llm = make_llm(base, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAError, match="r=16 exceeds max_lora_rank=8"):
        llm.generate([[5, 6, 7], [8, 9]], _greedy(), lora_request=[None, _lora(ads, 16)])
    assert not llm.engine.has_unfinished() and llm.list_loras() == []  # nothing was queued or loaded
    llm.add_lora(_lora(ads, 4))
    with pytest.raises(LoRAError, match="lora_int_id 4 already names adapter 'r4'"):
        llm.add_lora(LoRARequest("other", 4, str(ads[4])))
    with pytest.raises(ValueError, match="embedding requests with a LoRA adapter"):
        llm.engine.add_request([5, 6], pooling="last", lora_request=_lora(ads, 4))
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, str(ads[4]))
    with pytest.raises(ValueError, match="enable_lora does not support tensor_parallel_size > 1"):
        EngineConfig(model=str(base), enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model=str(base), enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_fp8_kv_cache_with_adapters(
    adapters: dict[str, Adapters], references: Callable[[str], MergedReference], make_llm: Callable[..., LLM]
) -> None:
    # A lossy cache is not held to exact greedy parity (docs/design.md): the adapter runs with it, each prompt's first
    # token matches the merged reference, and the adapter still steers the output away from the base model's.
    ads, ref = adapters["llama"], references("llama")
    llm = make_llm(ref.base, enable_lora=True, kv_cache_dtype="fp8")
    prompts = _prompts(8, (5, 17, 30, 12))
    lora = _lora(ads, 8)
    outputs = llm.generate(prompts, _greedy(), lora_request=lora)
    base_outputs = llm.generate(prompts, _greedy())
    for out, base_out, prompt in zip(outputs, base_outputs, prompts, strict=True):
        assert out.token_ids[0] == ref.greedy(ads[8], prompt, 8)[0]
        assert base_out.token_ids[0] == ref.greedy(None, prompt, 8)[0]
    assert any(o.token_ids != b.token_ids for o, b in zip(outputs, base_outputs, strict=True))


def test_request_without_a_slot_does_not_block_others(
    adapters: dict[str, Adapters], references: Callable[[str], MergedReference], make_llm: Callable[..., LLM]
) -> None:
    ads, ref = adapters["llama"], references("llama")
    llm = make_llm(ref.base, enable_lora=True, max_loras=1)
    engine = llm.engine
    prompts = _prompts(9, (11, 7, 9, 13))
    plan = [(4, 12), (8, 4), (None, 4), (4, 4)]  # (adapter rank, max tokens) in arrival order
    ids = [
        engine.add_request(p, _greedy(n), lora_request=_lora(ads, r) if r else None)
        for p, (r, n) in zip(prompts, plan, strict=True)
    ]
    finals = {}
    engine.step()
    # r4 holds the only slot: r8's request waits, while the base request and r4's second one behind it run.
    running = {seq.request_id for seq in engine.scheduler.running}
    assert running == {ids[0], ids[2], ids[3]}
    assert [seq.request_id for seq in engine.scheduler.waiting] == [ids[1]]
    while engine.has_unfinished():
        finals.update({d.request_id: d.final for d in engine.step() if d.final is not None})
    for rid, prompt, (rank, n) in zip(ids, prompts, plan, strict=True):
        assert finals[rid].token_ids == ref.greedy(ads[rank] if rank else None, prompt, n)
