"""AsyncEngine: concurrent streams, deltas that add up, aborts (explicit and by leaving the stream),
resuming from delivered tokens, stats, and an event loop that keeps running during steps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gpu_workers.engine import LLM, AsyncEngine, RequestDelta, SamplingParams

from .conftest import HFReference, random_prompts

PROMPTS = [p for p, _ in random_prompts(seed=21)]


def _greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def engine(model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]) -> AsyncIterator[AsyncEngine]:
    llm = make_llm(model_dir("llama"))
    async with AsyncEngine(engine=llm.engine) as eng:
        yield eng


async def _collect(
    engine: AsyncEngine, prompt: list[int] | str, params: SamplingParams, **kw: str
) -> list[RequestDelta]:
    return [d async for d in engine.generate(prompt, params, **kw)]


async def test_concurrent_streams_match_the_reference_and_add_up(
    engine: AsyncEngine, model_dir: Callable[[str], Path], hf_reference: HFReference
) -> None:
    lengths = [5, 17, 30, 9, 24, 40]
    results = await asyncio.gather(
        *(_collect(engine, PROMPTS[i + 4], _greedy(n), request_id=f"req-{i}") for i, n in enumerate(lengths))
    )
    for i, deltas in enumerate(results):
        final = deltas[-1]
        assert final.finished and final.finish_reason == "length" and final.final is not None
        assert all(not d.finished for d in deltas[:-1])
        assert {d.request_id for d in deltas} == {f"req-{i}"}
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == final.final.token_ids == hf_reference.greedy(model_dir("llama"), PROMPTS[i + 4], lengths[i])
        assert "".join(d.text for d in deltas) == final.final.text
        assert final.num_prompt_tokens == len(PROMPTS[i + 4]) and final.num_output_tokens == lengths[i]
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


async def test_stop_string_is_never_streamed(engine: AsyncEngine) -> None:
    full = (await _collect(engine, PROMPTS[3], _greedy(40)))[-1].final
    assert full is not None
    text = full.text
    stop = next(text[i : i + 4] for i in range(len(text) // 2, len(text) - 4) if "\ufffd" not in text[i : i + 4])
    deltas = await _collect(engine, PROMPTS[3], _greedy(40, stop=stop))
    streamed = "".join(d.text for d in deltas)
    assert streamed == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


async def test_abort_ends_the_stream_and_frees_blocks(engine: AsyncEngine) -> None:
    received = []
    async for delta in engine.generate(PROMPTS[10], _greedy(300), request_id="long"):
        received.append(delta)
        if len(received) == 3:
            await engine.abort("long")
    assert received[-1].finished and received[-1].finish_reason == "abort"
    assert 3 <= len(received) < 300
    await _wait_idle(engine)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_leaving_the_stream_early_aborts_the_request(engine: AsyncEngine) -> None:
    async def take_two() -> None:
        stream = engine.generate(PROMPTS[11], _greedy(300), request_id="impatient")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()

    await take_two()
    await _wait_idle(engine)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


async def test_resume_from_delivered_tokens(
    engine: AsyncEngine, model_dir: Callable[[str], Path], hf_reference: HFReference
) -> None:
    reference = hf_reference.greedy(model_dir("llama"), PROMPTS[7], 20)
    first = await _collect(engine, PROMPTS[7], _greedy(8))
    delivered = [t for d in first for t in d.token_ids]
    assert delivered == reference[:8]
    resumed = await _collect(engine, PROMPTS[7] + delivered, _greedy(12))
    assert [t for d in resumed for t in d.token_ids] == reference[8:]
    # The resumed prompt's prefix was cached by the first run.
    assert resumed[-1].num_cached_tokens > 0


async def test_event_loop_keeps_running_while_the_engine_steps(engine: AsyncEngine) -> None:
    # Each of the first steps holds itself open until a coroutine on the event loop has answered.
    # Were the step run on the loop's thread (or did it block the loop), nobody could answer and the
    # wait would time out. A structural check rather than a timing one, so machine load cannot flake it.
    loop_thread = threading.get_ident()
    inner = engine.engine.step
    in_step = threading.Event()
    answered = threading.Event()
    step_threads: set[int] = set()
    waits: list[bool] = []
    checked_steps = 5

    def watched_step() -> list[RequestDelta]:
        step_threads.add(threading.get_ident())
        if len(waits) < checked_steps:
            answered.clear()
            in_step.set()
            waits.append(answered.wait(timeout=10.0))
            in_step.clear()
        return inner()

    async def answer_during_steps() -> None:
        while len(waits) < checked_steps:
            if in_step.is_set() and not answered.is_set():
                answered.set()
            await asyncio.sleep(0.001)

    engine.engine.step = watched_step  # type: ignore[method-assign]
    try:
        answering = asyncio.create_task(answer_during_steps())
        results = await asyncio.gather(*(_collect(engine, PROMPTS[i], _greedy(40)) for i in range(6, 14)))
        await asyncio.wait_for(answering, timeout=10.0)
    finally:
        engine.engine.step = inner  # type: ignore[method-assign]
    assert waits == [True] * checked_steps
    assert loop_thread not in step_threads
    assert all(r[-1].finished and r[-1].num_output_tokens == 40 for r in results)


async def test_stats_and_validation(engine: AsyncEngine) -> None:
    stream = engine.add_request(PROMPTS[12], _greedy(60), request_id="watched", priority=2)
    seen_running = False
    async for _ in stream:
        seen_running = seen_running or engine.stats().num_running == 1
    assert seen_running
    with pytest.raises(ValueError, match="priority"):
        engine.add_request(PROMPTS[0], _greedy(4), priority="urgent")
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request([5] * 500, _greedy(100))
    dup = engine.add_request(PROMPTS[0], _greedy(30), request_id="dup")
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(PROMPTS[1], _greedy(4), request_id="dup")
    assert [d async for d in dup][-1].num_output_tokens == 30
    text_deltas = await _collect(engine, "The river ran", _greedy(5), priority=0)
    assert text_deltas[-1].final is not None and text_deltas[-1].final.prompt == "The river ran"


async def test_shutdown_aborts_in_flight_requests(
    model_dir: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    llm = make_llm(model_dir("llama"))
    engine = AsyncEngine(engine=llm.engine)
    await engine.start()
    stream = engine.add_request(PROMPTS[9], _greedy(300))
    first = await stream.__anext__()
    assert not first.finished
    await engine.shutdown()
    rest = [d async for d in stream]
    assert rest[-1].finish_reason == "abort"
    assert not engine.is_running


async def _wait_idle(engine: AsyncEngine) -> None:
    """The step thread applies aborts asynchronously; poll its stats snapshot for up to 10 s."""
    for _ in range(1000):
        stats = engine.stats()
        if not stats.num_running and not stats.num_waiting and _pool_whole(engine):
            return
        await asyncio.sleep(0.01)
    pytest.fail("engine did not go idle")


def _pool_whole(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks
