"""ProcessEngine: the step loop in a child process gives the same streams as the engine itself, refuses bad
requests at once, aborts, shuts down cleanly, and fails loudly (never silently) when its process dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, GuidedDecoding, RequestDelta, SamplingParams
from gpu_workers.engine.entrypoints.process_engine import ProcessEngine

from .conftest import MAX_MODEL_LEN, HFReference, random_prompts

PROMPTS = [p for p, _ in random_prompts(seed=33)]
ENGINE_ARGS = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 256}


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _make(model: Path, **kwargs: object) -> ProcessEngine:
    return ProcessEngine(str(model), **{**ENGINE_ARGS, **kwargs})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def engine(model_dir: Callable[[str], Path]) -> AsyncIterator[ProcessEngine]:
    async with _make(model_dir("llama")) as eng:
        yield eng


async def _collect(
    engine: ProcessEngine, prompt: list[int] | str, params: SamplingParams, **kw: str
) -> list[RequestDelta]:
    return [d async for d in engine.generate(prompt, params, **kw)]


async def _wait_idle(engine: ProcessEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        assert time.monotonic() < deadline, f"engine did not go idle: {stats}"
        await asyncio.sleep(0.01)


async def test_streams_match_the_reference_and_run_in_another_process(
    engine: ProcessEngine, model_dir: Callable[[str], Path], hf_reference: HFReference
) -> None:
    assert engine.spec is not None and engine.spec.pid == engine.pid != os.getpid()
    lengths = [6, 19, 3, 27]
    results = await asyncio.gather(
        *(_collect(engine, PROMPTS[i], _greedy(n), request_id=f"p-{i}") for i, n in enumerate(lengths))
    )
    for i, deltas in enumerate(results):
        final = deltas[-1]
        assert final.finished and final.finish_reason == "length" and final.final is not None
        assert all(not d.finished for d in deltas[:-1])
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == final.final.token_ids == hf_reference.greedy(model_dir("llama"), PROMPTS[i], lengths[i])
        assert "".join(d.text for d in deltas) == final.final.text
    # Text prompts are tokenized by the front with the model's own tokenizer.
    text = (await _collect(engine, "hello there", _greedy(4)))[-1]
    assert text.num_prompt_tokens == len(engine.tokenizer("hello there").input_ids)
    await _wait_idle(engine)


async def test_a_seeded_request_repeats_the_engine_s_own_sampling(
    engine: ProcessEngine, model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    ours = (await _collect(engine, PROMPTS[5], params))[-1].final
    offline = make_llm(model_dir("llama")).generate([PROMPTS[5]], params)[0]
    assert ours is not None and ours.token_ids == offline.token_ids


async def test_bad_requests_are_refused_at_once_and_the_engine_keeps_serving(engine: ProcessEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_MODEL_LEN))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 2, 10**6], _greedy(2))
    with pytest.raises(ValueError, match="unknown priority"):
        engine.add_request(PROMPTS[0], _greedy(2), priority="urgent")
    stream = engine.add_request(PROMPTS[1], _greedy(200), request_id="dup")
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(PROMPTS[2], _greedy(2), request_id="dup")
    await engine.abort("dup")
    assert [d async for d in stream][-1].finish_reason == "abort"
    assert (await _collect(engine, PROMPTS[2], _greedy(3)))[-1].finish_reason == "length"
    await _wait_idle(engine)


async def test_abort_and_leaving_a_stream_early_end_requests_and_free_the_cache(engine: ProcessEngine) -> None:
    stream = engine.add_request(PROMPTS[3], _greedy(400), request_id="to-abort")
    first = await stream.__anext__()
    assert first.token_ids and not first.finished
    await engine.abort("to-abort")
    rest = [d async for d in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    async for _ in engine.generate(PROMPTS[4], _greedy(400), request_id="left-early"):
        break
    await _wait_idle(engine)
    assert engine.stats().num_total_blocks == 256


async def test_shutdown_aborts_what_is_in_flight_and_stops_the_process(model_dir: Callable[[str], Path]) -> None:
    engine = _make(model_dir("llama"))
    await engine.start()
    stream = engine.add_request(PROMPTS[6], _greedy(400))
    await stream.__anext__()
    await engine.shutdown()
    assert [d async for d in stream][-1].finish_reason == "abort"
    assert not engine.is_running
    assert engine._process is not None and engine._process.returncode == 0
    with pytest.raises(RuntimeError, match="stopped"):
        engine.add_request(PROMPTS[0], _greedy(2))


async def test_a_killed_engine_process_fails_its_streams_and_stops_serving(model_dir: Callable[[str], Path]) -> None:
    engine = _make(model_dir("llama"))
    await engine.start()
    try:
        stream = engine.add_request(PROMPTS[7], _greedy(400))
        await stream.__anext__()
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            engine.add_request(PROMPTS[0], _greedy(2))
    finally:
        await engine.shutdown()


async def test_a_model_that_cannot_load_fails_start_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["NoSuchForCausalLM"]}')
    engine = ProcessEngine(str(tmp_path))
    with pytest.raises(ValueError, match=r"unsupported architecture \['NoSuchForCausalLM'\]"):
        await engine.start()
    assert engine._process is not None and engine._process.returncode is not None
    assert not engine.is_running
    with pytest.raises(ValueError, match="does not exist"):
        await ProcessEngine(str(tmp_path / "missing")).start()


def test_bad_engine_arguments_are_refused_before_any_process_starts(model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="block_size"):
        ProcessEngine(str(model_dir("llama")), block_size=0)


def test_the_engine_process_exits_when_its_front_is_killed(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    script = textwrap.dedent(
        f"""
        import asyncio, pathlib
        from gpu_workers.engine.entrypoints.process_engine import ProcessEngine

        async def main():
            engine = ProcessEngine({str(model_dir("llama"))!r}, max_model_len=512, num_kv_blocks=64)
            await engine.start()
            engine.add_request([5, 6, 7], __import__("gpu_workers.engine").engine.SamplingParams(max_tokens=400))
            pathlib.Path({str(pid_file)!r}).write_text(str(engine.pid))
            await asyncio.sleep(120)

        asyncio.run(main())
        """
    )
    front = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert front.poll() is None, "the front exited before its engine was ready"
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.05)
        engine_pid = int(pid_file.read_text())
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 15
        while _alive(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its front"
            time.sleep(0.05)
    finally:
        if front.poll() is None:
            front.kill()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (an exited child not yet reaped by its dead parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_choices_logprobs_and_grammars_cross_the_process_boundary(engine: ProcessEngine) -> None:
    """n > 1, logprobs and a grammar through the engine process: every choice streams, ends, and is valid."""
    assert engine.max_model_len == MAX_MODEL_LEN
    params = SamplingParams(
        temperature=1.0, seed=2, n=2, max_tokens=40, logprobs=2, guided=GuidedDecoding(choice=["alpha", "beta"])
    )
    deltas = await _collect(engine, [5, 6, 7, 8], params)
    assert sorted(d.index for d in deltas if d.finished) == [0, 1]
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert "".join(d.text for d in mine) in ("alpha", "beta")
        tokens = [t for d in mine for t in d.token_ids]
        logprobs = [lp for d in mine for lp in d.logprobs or []]
        assert [lp.token_id for lp in logprobs] == tokens and all(len(lp.top) == 2 for lp in logprobs)
    with pytest.raises(ValueError, match="invalid regex"):
        await _collect(engine, [5, 6], SamplingParams(guided=GuidedDecoding(regex="(unclosed")))
    await _wait_idle(engine)
