"""Prompt-taking CPU steps on more threads than decode steps (``execution/cpu_step_threads.py``): the count each
kind of step runs on, the same tokens either way, and the refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gpu_workers.engine import LLM, SamplingParams
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.execution.cpu_step_threads import CpuStepThreads


@pytest.fixture
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.usefixtures("one_thread")
def test_nothing_switches_on_a_gpu_without_a_count_or_with_the_decode_count() -> None:
    assert CpuStepThreads.from_config(0, torch.device("cpu")) is None
    assert CpuStepThreads.from_config(1, torch.device("cpu")) is None  # the decode count already
    assert CpuStepThreads.from_config(2, torch.device("cuda")) is None
    threads = CpuStepThreads.from_config(2, torch.device("cpu"))
    assert threads is not None and (threads.decode_threads, threads.prefill_threads) == (1, 2)
    threads.enter(decode_only=False)
    assert torch.get_num_threads() == 2
    threads.enter(decode_only=True)
    assert torch.get_num_threads() == 1


@pytest.mark.usefixtures("one_thread")
def test_prefills_run_on_their_threads_decodes_on_the_engines_and_the_tokens_do_not_change(
    make_llm: Callable[..., LLM], model_dir: Callable[[str], Path]
) -> None:
    model = model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 13, 40, 41, 42, 77], [3, 4, 5]]
    plain = [o.token_ids for o in make_llm(model, dtype="float32").generate(prompts, params)]
    llm = make_llm(model, dtype="float32", cpu_prefill_threads=2)
    seen: list[tuple[int, int]] = []  # (tokens in the step, threads it ran on)
    forward = llm.engine.runner.model.forward

    def recording(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((int(input_ids.shape[0]), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    llm.engine.runner.model.forward = recording  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert seen[0] == (10, 2)  # both prompts in one step, on the prefill threads
    assert all(threads == 1 for tokens, threads in seen[1:]) and len(seen) == 6  # five decode steps


def test_a_bad_count_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cpu_prefill_threads must be >= 0"):
        EngineConfig(model="m", cpu_prefill_threads=-1)
    with pytest.raises(ValueError, match="cpu_prefill_threads must be an int"):
        EngineConfig(model="m", cpu_prefill_threads=True)  # type: ignore[arg-type]
