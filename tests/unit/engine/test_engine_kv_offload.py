"""The KV offload tiers under the prefix cache: greedy float32 outputs are the same with tiers on and off while a
pool too small for the working set evicts blocks and loads them back; tier hits count as cached prompt tokens; a
restarted engine finds its disk tier; and a damaged block, another adapter or another KV dtype is recomputed, never
used."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.lora.request import LoRARequest

from .lora_adapters import make_adapter

BLOCK = 4
# Room for one request at max_model_len and little else: every new prompt evicts the blocks of the last ones.
POOL = dict(block_size=BLOCK, max_model_len=96, num_kv_blocks=26, dtype="float32", max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _conversations(seed: int) -> list[list[int]]:
    """Turns of three conversations on one shared system prompt, each turn its conversation's history plus new
    tokens: a multi-turn chat in token ids."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 512) for _ in range(30)]
    histories = [list(system) for _ in range(3)]
    turns = []
    for _ in range(3):
        for history in histories:
            history += [rng.randrange(3, 512) for _ in range(rng.randint(5, 12))]
            turns.append(list(history))
    return turns


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Each prompt alone (so each finds what the ones before it left), its tokens and the cached tokens in all."""
    outputs, cached = [], 0
    for prompt in prompts:
        out = llm.generate([prompt], GREEDY)[0]
        outputs.append(out.token_ids)
        cached += out.num_cached_tokens
    return outputs, cached


def _tiers(tmp_path: Path, **overrides: object) -> dict[str, object]:
    tiers: dict[str, object] = dict(host_bytes=1 << 24, disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 26)
    return tiers | overrides


def test_greedy_outputs_are_the_same_with_tiers_on_and_off(make_llm: Callable[..., LLM], model_dir, tmp_path) -> None:
    prompts = _conversations(1) * 2  # the second pass finds every prompt evicted from the pool
    plain, plain_cached = _run(make_llm(model_dir("llama"), **POOL), prompts)
    for tiers in (_tiers(tmp_path / "both"), dict(host_bytes=1 << 24), _tiers(tmp_path / "disk", host_bytes=0)):
        llm = make_llm(model_dir("llama"), **POOL, kv_offload=tiers)
        tiered, tiered_cached = _run(llm, prompts)
        stats = llm.engine.stats().kv_offload
        assert tiered == plain
        assert stats is not None and stats.damaged == 0
        assert stats.hits["host"] + stats.hits["disk"] > 0, "the pool was large enough: nothing came from a tier"
        # Blocks loaded from a tier count as cached prompt tokens, as pool hits do.
        assert tiered_cached > plain_cached
        llm.engine.close()


def test_a_restarted_engine_serves_its_disk_tier(make_llm: Callable[..., LLM], model_dir, tmp_path) -> None:
    prompts = _conversations(2)
    first = make_llm(model_dir("llama"), **POOL, kv_offload=_tiers(tmp_path, host_bytes=0))
    expected, _ = _run(first, prompts)
    first.engine.offloader.flush()
    first.engine.close()
    again = make_llm(model_dir("llama"), **POOL, kv_offload=_tiers(tmp_path, host_bytes=0), enable_kv_events=True)
    held = {e.tier: e for e in again.engine.kv_snapshot().tiers}
    assert held["disk"].snapshot and len(held["disk"].stored) > 0  # what a restarted worker re-publishes
    out = again.generate([prompts[-1]], GREEDY)[0]
    assert out.token_ids == expected[-1]
    assert out.num_cached_tokens >= BLOCK * ((len(prompts[-1]) - 1) // BLOCK) - BLOCK
    assert again.engine.stats().kv_offload.hits["disk"] > 0
    again.engine.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_disk_block_is_recomputed(make_llm: Callable[..., LLM], model_dir, tmp_path, damage: str) -> None:
    prompt = _conversations(3)[-1]
    first = make_llm(model_dir("llama"), **POOL, kv_offload=_tiers(tmp_path, host_bytes=0))
    expected = first.generate([prompt], GREEDY)[0].token_ids
    first.engine.offloader.flush()
    first.engine.close()
    files = sorted((tmp_path / "kv").rglob("*.kvblock"))
    assert len(files) >= 2
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncate":
            del data[len(data) // 2 :]
        path.write_bytes(bytes(data))
    if damage == "swap":  # whole, well-formed blocks under each other's names
        a, b = files[0].read_bytes(), files[1].read_bytes()
        files[0].write_bytes(b)
        files[1].write_bytes(a)
    again = make_llm(model_dir("llama"), **POOL, kv_offload=_tiers(tmp_path, host_bytes=0))
    out = again.generate([prompt], GREEDY)[0]
    stats = again.engine.stats().kv_offload
    assert out.token_ids == expected
    assert stats.damaged >= 1
    assert stats.hits["disk"] == 0 or damage == "swap"  # a swap leaves the blocks before the first swapped one
    again.engine.close()


def test_another_kv_dtype_finds_nothing(make_llm: Callable[..., LLM], model_dir, tmp_path) -> None:
    prompt = _conversations(4)[-1]
    tiers = _tiers(tmp_path, host_bytes=0)
    first = make_llm(model_dir("llama"), **POOL, kv_offload=tiers)
    first.generate([prompt], GREEDY)
    first.engine.offloader.flush()
    first.engine.close()
    fp8 = make_llm(model_dir("llama"), **POOL, kv_offload=tiers, kv_cache_dtype="fp8", attention_backend="torch")
    reference = make_llm(model_dir("llama"), **POOL, kv_cache_dtype="fp8", attention_backend="torch")
    out = fp8.generate([prompt], GREEDY)[0]
    assert out.token_ids == reference.generate([prompt], GREEDY)[0].token_ids
    assert fp8.engine.stats().kv_offload.hits == {"host": 0, "disk": 0, "shared": 0}
    assert out.num_cached_tokens == 0
    fp8.engine.close()


def test_another_adapter_finds_nothing(make_llm: Callable[..., LLM], model_dir, tmp_path) -> None:
    base = model_dir("llama")
    adapter = make_adapter(base, tmp_path / "adapter", 4, seed=4)
    lora = LoRARequest("r4", 1, str(adapter))
    prompt = _conversations(5)[-1]
    tiers = _tiers(tmp_path)
    llm = make_llm(base, **POOL, kv_offload=tiers, enable_lora=True)
    llm.generate([prompt], GREEDY)  # the base model's blocks go down
    llm.engine.offloader.flush()
    evict = [random.Random(9).randrange(3, 512) for _ in range(90)]
    llm.generate([evict], GREEDY)  # and leave the pool
    plain = make_llm(base, **POOL, enable_lora=True)
    out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
    assert out.token_ids == plain.generate([prompt], GREEDY, lora_request=lora)[0].token_ids
    assert out.num_cached_tokens == 0
    assert sum(llm.engine.stats().kv_offload.hits.values()) == 0
    llm.engine.close()
