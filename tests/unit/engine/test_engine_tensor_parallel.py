"""Tensor parallelism on CPU, 2 ranks under gloo: greedy tokens equal tensor_parallel_size=1 for Llama, Mistral
(one KV head: replicated on both ranks), Qwen2 (Q/K/V biases), Phi-3 and Phi-4-mini (fused checkpoint projections
cut into each rank's parts) and tied-embedding Llama 3 (GQA 4:1, vocab-parallel embedding shared with the LM head),
with chunked prefill, prefix caching and n > 1 (copy-on-write block copies); unsupported combinations are refused
by name; a rank that dies fails the step, not hangs; an engine idle for longer than the group's timeout still
serves (its other ranks wait for commands however long), and rank 0's death ends that wait at once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from gpu_workers.engine import LLM, EngineConfig, SamplingParams
from gpu_workers.engine.models.random_checkpoint import make_tiny_model

from .conftest import shared_prefix_prompts

pytestmark = pytest.mark.timeout(300)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    spread = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 70))] for _ in range(4)]
    return spread + [p for p, _ in shared_prefix_prompts(seed)[:3]]


@pytest.fixture
def tp_llms() -> Iterator[Callable[..., LLM]]:
    """Factory for TP engines; each is closed (its other ranks stopped) after the test."""
    made: list[LLM] = []

    def make(path: Path, **kwargs: object) -> LLM:
        llm = LLM(str(path), max_model_len=256, num_kv_blocks=96, tensor_parallel_size=2, **kwargs)  # type: ignore[arg-type]
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.close()
        for process in llm.engine.tp_ranks.processes if llm.engine.tp_ranks else []:
            assert not process.is_alive(), "a tensor-parallel rank outlived its engine"


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3", "llama3_tied", "phi3_longrope", "phi4mini"])
def test_two_ranks_decode_the_same_greedy_tokens(
    variant: str,
    model_dir: Callable[[str], Path],
    make_llm: Callable[..., LLM],
    tp_llms: Callable[..., LLM],
    tmp_path: Path,
) -> None:
    # Mistral with a single KV head, so both ranks keep a copy of it.
    path = (
        make_tiny_model(tmp_path / "mistral1kv", arch="mistral", seed=1, num_kv_heads=1)
        if (variant == "mistral")
        else model_dir(variant)
    )
    prompts = _prompts(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    two = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    options = {"max_num_batched_tokens": 48}  # chunked prefill: prompts take several steps
    base = make_llm(path, max_model_len=256, num_kv_blocks=96, **options)
    tp = tp_llms(path, **options)
    assert [o.token_ids for o in tp.generate(prompts, greedy)] == [o.token_ids for o in base.generate(prompts, greedy)]
    # n = 2 forks a sequence and copies its partial block on every rank.
    fork_tp = tp.generate(prompts[:2], two)
    fork_base = base.generate(prompts[:2], two)
    assert [[c.token_ids for c in o.choices] for o in fork_tp] == [[c.token_ids for c in o.choices] for o in fork_base]
    stats = tp.engine.stats()
    assert stats.prefix_cache_hit_rate > 0  # the shared-prefix prompts hit the (rank-0-managed) cache


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"quantization": "fp8"}, "does not support quantization"),
        ({"kv_cache_dtype": "fp8"}, "FP8 KV cache"),
        ({"speculative_config": {"method": "draft_model", "model": "x"}}, "draft model"),
    ],
)
def test_unsupported_combinations_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **{"tensor_parallel_size": 2, **options})  # type: ignore[arg-type]


def test_heads_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(str(path), max_model_len=64, num_kv_blocks=16, tensor_parallel_size=3, tensor_parallel_timeout_s=20)


def test_a_dead_rank_fails_the_step_instead_of_hanging(
    model_dir: Callable[[str], Path], tp_llms: Callable[..., LLM]
) -> None:
    llm = tp_llms(model_dir("llama"), tensor_parallel_timeout_s=20)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], greedy)[0].token_ids) == 4
    ranks = llm.engine.tp_ranks
    assert ranks is not None
    (follower,) = ranks.processes
    assert follower.pid is not None
    os.kill(follower.pid, signal.SIGKILL)
    follower.join(timeout=10)
    with pytest.raises(RuntimeError):
        llm.generate([[8, 9, 10]], greedy)


@pytest.mark.slow
def test_an_engine_idle_past_the_group_timeout_still_serves(
    model_dir: Callable[[str], Path], tp_llms: Callable[..., LLM]
) -> None:
    # The group's timeout bounds collectives under way; the other ranks' wait for rank 0's next command is not
    # one. A follower that timed out there left the group, and the engine failed its next request.
    timeout_s = 10
    llm = tp_llms(model_dir("llama"), tensor_parallel_timeout_s=timeout_s)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], greedy)[0].token_ids
    time.sleep(timeout_s + 3)
    assert llm.generate([[5, 6, 7]], greedy)[0].token_ids == first
    ranks = llm.engine.tp_ranks
    assert ranks is not None and all(p.is_alive() for p in ranks.processes)


RANK_ZERO = """
import sys, time
from gpu_workers.engine import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2, tensor_parallel_timeout_s=60)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    print(llm.engine.tp_ranks.processes[0].pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_follower_waiting_for_commands_leaves_when_rank_zero_dies(
    model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    # The followers' wait for commands has no deadline that matters, so rank 0's death must end it: a rank 0 killed
    # with its worker (kill -9) would otherwise leave its followers behind, holding their shards' memory.
    script = tmp_path / "rank_zero.py"
    script.write_text(RANK_ZERO)
    root = Path(__file__).resolve().parents[3]
    paths = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    rank_zero = subprocess.Popen(
        [sys.executable, str(script), str(model_dir("llama"))], stdout=subprocess.PIPE, text=True, env=env
    )
    follower: psutil.Process | None = None
    try:
        assert rank_zero.stdout is not None
        follower = psutil.Process(int(rank_zero.stdout.readline()))
        rank_zero.kill()
        rank_zero.wait(timeout=30)
        follower.wait(timeout=20)  # psutil.TimeoutExpired if the follower is still waiting
    finally:
        rank_zero.kill()
        if follower is not None and follower.is_running():  # a failed run must not leave it waiting forever
            follower.kill()
