"""The GPU worker in-process against real Kafka and Redis: resuming a partial stream with seamless text,
skipping a re-delivered finished request, and riding out Redis restarts (with and without persistence).

Requests go straight onto the model's Kafka topic; what the worker did is read back from Redis streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from fault_report import count_events, fault_report
from private_redis import RedisServer
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gpu_workers.engine import AsyncEngine, SamplingParams
from gpu_workers.worker import control
from gpu_workers.worker.config import WorkerConfig
from gpu_workers.worker.control import Cancels
from gpu_workers.worker.in_flight import Active, InFlight
from gpu_workers.worker.main import run_worker
from gpu_workers.worker.outputs import Outputs
from gpu_workers.worker.reader_leases import ReaderWatch
from gpu_workers.worker.resume import Continuation
from gpu_workers.worker.stream_state import read_stream_state
from gpu_workers.worker.streams import RecordWrite, StreamPublisher
from schemas import (
    STREAM_FIELD,
    CancelRequest,
    DoneEvent,
    InferenceRequest,
    Names,
    RestartEvent,
    SamplingOptions,
    StreamEvent,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
    parse_stream_event,
)
from schemas.names import HEADER_REQUEST_ID, Tier
from sluicegate.kafka import create_admin, create_producer
from sluicegate.settings import Settings
from sluicegate.task_stop import cancel_and_wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "tiny-worker"
PROMPT = "The river ran quietly past the old mill"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("worker-model") / MODEL, num_layers=2, hidden_size=64)


@pytest.fixture(scope="module")
def paced_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger random model (6 layers, hidden 384: ~5 ms a token on an idle core, the tiny one ~1 ms), for a
    request that must still be generating when the test acts."""
    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("paced-model") / MODEL, num_layers=6, hidden_size=384)


@dataclass
class Reference:
    """An uninterrupted run: its per-step deltas (what a worker streams) and the final text."""

    prompt_ids: list[int]
    deltas: list[tuple[str, list[int]]]
    text: str

    @property
    def token_ids(self) -> list[int]:
        return [t for _, ids in self.deltas for t in ids]


async def reference_run(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams) -> Reference:
    deltas = [(d.text, list(d.token_ids)) async for d in engine.generate(prompt_ids, params)]
    return Reference(prompt_ids, deltas, "".join(text for text, _ in deltas))


@pytest.fixture(scope="module")
async def engine(model_dir: Path) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(str(model_dir), device="cpu", cpu_kv_cache_gb=0.05) as running:
        yield running


def request_for(max_tokens: int, stop: list[str] | None = None, request_id: str | None = None) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id or uuid.uuid4().hex,
        model=MODEL,
        prompt=PROMPT,
        sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop or []),
    )


# --- text continuity, engine only -------------------------------------------------------------------------


async def _resume_all_points(engine: AsyncEngine, stop: list[str] | None) -> tuple[Reference, int]:
    """Resume the request after every delivered delta; returns the reference and how many resume points
    a naive continuation (delivered text + the engine's own text for the rest) would get wrong."""
    max_tokens = 48
    request = request_for(max_tokens, stop)
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop)
    ref = await reference_run(engine, prompt_ids, params)
    eos = engine.eos_token_ids
    naive_wrong = 0
    for k in range(1, len(ref.deltas)):
        delivered_ids = [t for _, ids in ref.deltas[:k] for t in ids]
        delivered_text = "".join(text for text, _ in ref.deltas[:k])
        cont = Continuation(request, engine.tokenizer, prompt_ids, delivered_ids, delivered_text, eos)
        assert cont.consistent
        emitted = delivered_text
        naive = delivered_text
        ended = cont.finished_already()
        if ended is None:
            rest = SamplingParams(
                temperature=0.0, max_tokens=max_tokens - len(delivered_ids), ignore_eos=True, stop=stop
            )
            async for delta in engine.generate(prompt_ids + delivered_ids, rest):
                naive += delta.text
                reason = "stop" if cont.feed(delta.token_ids) else delta.finish_reason
                if reason is not None:
                    cont.close(reason)
                emitted += cont.take(final=reason is not None)
                if reason is not None:
                    break
        else:
            cont.close(ended)
            emitted += cont.take(final=True)
        assert emitted == ref.text, f"resumed after {k} deltas"
        assert cont.token_ids[: len(ref.token_ids)] == ref.token_ids
        naive_wrong += naive != ref.text
    return ref, naive_wrong


async def test_resumed_text_equals_uninterrupted_text_at_every_resume_point(engine: AsyncEngine) -> None:
    ref, naive_wrong = await _resume_all_points(engine, stop=None)
    # The random model emits bytes that only form characters together, so text is held back at times;
    # the engine's own text for a resumed run loses it, the worker's continuation does not.
    assert "\ufffd" in ref.text or naive_wrong == 0
    assert naive_wrong > 0, "expected at least one resume point where the engine's own text differs"


async def test_resumed_text_honours_a_stop_string_across_the_resume_point(engine: AsyncEngine) -> None:
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    full = await reference_run(engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    # A stop string taken from the middle of the output, longer than one token's text.
    middle = full.text[len(full.text) // 2 :]
    stop = next(middle[i : i + 3] for i in range(len(middle) - 3) if "\ufffd" not in middle[i : i + 3])
    ref, _ = await _resume_all_points(engine, stop=[stop])
    assert stop not in ref.text and len(ref.text) < len(full.text)


def test_delivered_tokens_that_already_end_the_request_are_recognised(engine: AsyncEngine) -> None:
    """The previous owner died between the last token and ``done``: nothing more is generated."""
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    eos = engine.eos_token_ids
    tokenizer = engine.tokenizer
    ids = [tokenizer.encode(" river", add_special_tokens=False)[0]]
    stopping = InferenceRequest(
        request_id="r1", model=MODEL, prompt=PROMPT, sampling=SamplingOptions(temperature=0.0, max_tokens=9)
    )
    assert Continuation(stopping, tokenizer, prompt_ids, [*ids, min(eos)], "", eos).finished_already() == "stop"
    ignoring = stopping.model_copy(update={"sampling": SamplingOptions(max_tokens=9, ignore_eos=True)})
    assert Continuation(ignoring, tokenizer, prompt_ids, [*ids, min(eos)], "", eos).finished_already() is None
    stop_id = stopping.model_copy(update={"sampling": SamplingOptions(max_tokens=9, stop_token_ids=ids)})
    assert Continuation(stop_id, tokenizer, prompt_ids, ids, "", eos).finished_already() == "stop"
    text = tokenizer.decode(ids)
    stop_text = stopping.model_copy(update={"sampling": SamplingOptions(max_tokens=9, stop=[text.strip()])})
    cont = Continuation(stop_text, tokenizer, prompt_ids, ids, "", eos)
    assert cont.finished_already() == "stop" and cont.take(final=True) == text[: text.index(text.strip())]
    assert Continuation(request_for(1), tokenizer, prompt_ids, ids, "", eos).finished_already() == "length"


# --- the worker on Kafka and Redis --------------------------------------------------------------------------


@dataclass
class RunningWorker:
    settings: Settings
    names: Names
    redis: Redis
    stop: asyncio.Event
    task: asyncio.Task


@contextlib.asynccontextmanager
async def running_worker(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, prefix: str, **overrides: Any
) -> AsyncIterator[RunningWorker]:
    # ``overrides`` may replace any of these (a second worker's id, more partitions for two workers to share).
    defaults: dict[str, Any] = dict(
        topic_partitions=1, worker_id="w-int", kv_cache_gb=0.05, heartbeat_interval_s=0.3, drain_timeout_s=5.0
    )
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=prefix,
        model=str(model_dir),
        model_name=MODEL,
        **{**defaults, **overrides},
    )
    names = Names(prefix)
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, stop))
    redis = Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert not task.done(), task.exception()
            with contextlib.suppress(OSError, RedisError):
                beats = [
                    WorkerHeartbeat.model_validate_json(v)
                    for v in (await redis.hgetall(names.workers_key(MODEL))).values()
                ]
                if any(b.partitions for b in beats if b.worker_id == settings.worker_id):
                    # The engine, in this process or its own, names the model's architecture.
                    assert all(b.architecture == "LlamaForCausalLM" for b in beats), beats
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the worker never owned its partitions")
        yield RunningWorker(settings, names, redis, stop, task)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        await redis.aclose()
        admin = create_admin(bootstrap=kafka_bootstrap)
        await admin.start()
        with contextlib.suppress(Exception):
            await admin.delete_topics([t for t in await admin.list_topics() if t.startswith(prefix)])
        await admin.close()


async def publish(worker: RunningWorker, *requests: InferenceRequest | bytes, tier: Tier = "standard") -> None:
    producer = create_producer(worker.settings)
    await producer.start()
    try:
        topic = worker.names.request_topic(MODEL, tier)
        for item in requests:
            if isinstance(item, bytes):
                await producer.send_and_wait(topic, item)
            else:
                headers = [(HEADER_REQUEST_ID, item.request_id.encode())]
                await producer.send_and_wait(topic, item.model_dump_json().encode(), headers=headers)
    finally:
        await producer.stop()


async def read_events(redis: Redis, names: Names, request_id: str) -> list[StreamEvent]:
    entries = await redis.xrange(names.stream_key(request_id))
    return [parse_stream_event(fields[STREAM_FIELD.encode()]) for _, fields in entries]


async def wait_terminal(redis: Redis, names: Names, request_id: str, timeout_s: float = 60) -> list[StreamEvent]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, RedisError):
            events = await read_events(redis, names, request_id)
            if events and events[-1].type in ("done", "error"):
                return events
        await asyncio.sleep(0.05)
    raise AssertionError(f"request {request_id} did not finish within {timeout_s}s")


async def wait_heartbeat_after(redis: Redis, names: Names, wall_time: float, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = await redis.hget(names.workers_key(MODEL), "w-int")
        if raw is not None and WorkerHeartbeat.model_validate_json(raw).sent_at.timestamp() > wall_time:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no heartbeat after the Redis restart")


def report(name: str, **figures: object) -> None:
    print(f"\nFAULT-REPORT {json.dumps({'test': name, **figures})}")


def assert_exactly_once(events: list[StreamEvent], ref: Reference | None = None) -> str:
    """Seq 0..n contiguous, one ``done`` and it is last, usage matches the tokens; returns the text."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("done") == 1 and events[-1].type == "done"
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert done.usage.completion_tokens == len(tokens)
    if ref is not None:
        assert tokens == ref.token_ids
        assert text == ref.text
    return text


async def wait_idle_heartbeat(redis: Redis, names: Names, timeout_s: float = 15.0) -> WorkerHeartbeat:
    """The worker's heartbeat once it shows no request running or waiting and every KV block free."""
    deadline = time.monotonic() + timeout_s
    beat = None
    while time.monotonic() < deadline:
        raw = await redis.hgetall(names.workers_key(MODEL))
        beats = [WorkerHeartbeat.model_validate_json(v) for v in raw.values()]
        beat = beats[0] if beats else None
        if beat and not beat.running and not beat.waiting and beat.free_kv_blocks == beat.total_kv_blocks:
            return beat
        await asyncio.sleep(0.1)
    pytest.fail(f"the worker did not go idle with every KV block free: {beat}")


async def write_partial_stream(redis: Redis, names: Names, rid: str, deltas: list[tuple[str, list[int]]]) -> None:
    publisher = StreamPublisher(redis, names, ttl_s=600)
    for seq, (text, ids) in enumerate(deltas):
        publisher.add(TokenEvent(request_id=rid, seq=seq, text=text, token_ids=ids))
    await publisher.flush()


async def test_publisher_carries_record_writes_in_order_with_appends(redis_url: str, unique_prefix: str) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    rid = uuid.uuid4().hex
    key = names.request_key(rid)
    publisher = StreamPublisher(redis, names, ttl_s=600)
    try:
        publisher.add(RecordWrite(key, "running", 60, rid))
        publisher.add(TokenEvent(request_id=rid, seq=0, text="a", token_ids=[1]))
        publisher.add(RecordWrite(key, "finished", 60, rid))
        assert publisher.pending == 3
        await publisher.flush()
        assert await redis.get(key) == b"finished"  # the later write wins: one pipeline, in order
        assert 0 < await redis.ttl(key) <= 60
        assert publisher.appended == 1 and publisher.pending == 0
        assert len(await redis.xrange(names.stream_key(rid))) == 1
    finally:
        await redis.delete(key, names.stream_key(rid))
        await redis.aclose()


async def test_a_riding_record_goes_with_the_next_flush_or_alone_after_its_wait(
    redis_url: str, unique_prefix: str
) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    rid = uuid.uuid4().hex
    key = names.request_key(rid)
    batches: list[list[Any]] = []
    publisher = StreamPublisher(redis, names, ttl_s=600, on_send=lambda batch: batches.append(list(batch)))
    try:
        # Another request's flush within the wait carries the record: one pipeline for both.
        riding = asyncio.create_task(publisher.ride(RecordWrite(key, "finished", 60, rid), max_wait_s=30))
        await asyncio.sleep(0.05)
        assert not riding.done() and await redis.get(key) is None  # nothing flushed yet: it waits
        publisher.add(TokenEvent(request_id=rid, seq=0, text="a", token_ids=[1]))
        await publisher.flush()
        await asyncio.wait_for(riding, 5)
        assert len(batches) == 1 and len(batches[0]) == 2
        assert await redis.get(key) == b"finished"
        # Nothing else flushes: the record goes alone once its wait is over, and is stored when ride returns.
        started = time.monotonic()
        await publisher.ride(RecordWrite(key, "cancelled", 60, rid), max_wait_s=0.1)
        assert time.monotonic() - started >= 0.1
        assert len(batches) == 2 and await redis.get(key) == b"cancelled"
        assert publisher.pending == 0
    finally:
        await redis.delete(key, names.stream_key(rid))
        await redis.aclose()


async def test_a_flush_whose_items_went_with_another_leaves_later_ones_for_the_next(
    redis_url: str, unique_prefix: str
) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    rid = uuid.uuid4().hex
    key = names.request_key(rid)
    batches: list[list[Any]] = []
    token = TokenEvent(request_id=rid, seq=0, text="a", token_ids=[1])
    late = RecordWrite(key, "running", 60, rid)

    def sending(batch: Any) -> None:
        batches.append(list(batch))
        if len(batches) == 1:
            publisher.add(late)  # added while the first flush is under way, after it took its batch

    publisher = StreamPublisher(redis, names, ttl_s=600, on_send=sending)
    try:
        publisher.add(token)
        first = asyncio.create_task(publisher.flush())
        await asyncio.sleep(0)
        await publisher.flush(upto=1)  # the token: the first flush carries it, so this one sends nothing
        await first
        assert batches == [[token]] and publisher.pending == 1 and await redis.get(key) is None
        await publisher.flush()  # everything added: the record goes now
        assert batches == [[token], [late]] and publisher.pending == 0 and await redis.get(key) == b"running"
    finally:
        await redis.delete(key, names.stream_key(rid))
        await redis.aclose()


async def test_a_record_emitted_without_waking_goes_with_the_next_woken_flush(
    kafka_bootstrap: str, redis_url: str, unique_prefix: str
) -> None:
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    rid = uuid.uuid4().hex
    key = names.request_key(rid)
    batches: list[list[Any]] = []

    class Observer:
        def record_taken(self, record: Any) -> None:
            pass

        def events_sending(self, batch: Any) -> None:
            batches.append(list(batch))

    config = WorkerConfig(model_name="m", worker_id="w")
    producer = create_producer(bootstrap=kafka_bootstrap)  # never started: nothing here produces
    outputs = Outputs(config, names, redis, producer, Observer())
    entry = Active(request_id=rid, partition=TopicPartition(names.inbound_topic, 0), offset=0)
    loop = asyncio.create_task(outputs.flush_loop())
    try:
        assert outputs.emit(entry, RecordWrite(key, "running", 60, rid), wake=False)
        await asyncio.sleep(0.1)
        assert batches == [] and await redis.get(key) is None  # the flush loop slept on
        assert outputs.emit(entry, TokenEvent(request_id=rid, seq=0, text="a", token_ids=[1]))
        for _ in range(100):
            if batches:
                break
            await asyncio.sleep(0.01)
        assert [len(batch) for batch in batches] == [2]  # one pipeline: the record and the first token
        assert await redis.get(key) == b"running"
    finally:
        await cancel_and_wait(loop)
        await redis.delete(key, names.stream_key(rid))
        await redis.aclose()


async def test_worker_continues_a_partial_stream_and_skips_a_finished_one(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, engine: AsyncEngine, unique_prefix: str
) -> None:
    max_tokens = 40
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    ref = await reference_run(
        engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    # What a crashed worker left: a stream cut after 17 deltas, one cut after the last token but before
    # ``done``, and one that finished (re-delivered before its offset was committed).
    partial, no_done, finished, foreign = (request_for(max_tokens) for _ in range(4))
    await write_partial_stream(redis, names, partial.request_id, ref.deltas[:17])
    await write_partial_stream(redis, names, no_done.request_id, ref.deltas)
    await write_partial_stream(redis, names, finished.request_id, ref.deltas)
    # Text that this model's tokenizer does not make of these tokens (another model answered first).
    await write_partial_stream(redis, names, foreign.request_id, [("not what these tokens say", ref.token_ids[:3])])
    usage = Usage(
        prompt_tokens=len(prompt_ids), completion_tokens=max_tokens, total_tokens=len(prompt_ids) + max_tokens
    )
    publisher = StreamPublisher(redis, names, ttl_s=600)
    publisher.add(DoneEvent(request_id=finished.request_id, seq=len(ref.deltas), finish_reason="length", usage=usage))
    await publisher.flush()
    before = await redis.xrange(names.stream_key(finished.request_id))
    marker = request_for(4)
    try:
        async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix) as worker:
            await publish(worker, partial, no_done, finished, foreign, marker)
            await wait_terminal(redis, names, marker.request_id)
            for request in (partial, no_done):
                assert_exactly_once(await wait_terminal(redis, names, request.request_id), ref)
            # No seamless continuation exists: ``restart`` (drop everything), then the whole answer again.
            events = await wait_terminal(redis, names, foreign.request_id)
            assert isinstance(events[1], RestartEvent) and events[1].discard_after_seq == -1
            assert [e.seq for e in events] == list(range(len(events)))
            state = await read_stream_state(redis, names, foreign.request_id)
            assert state.token_ids == ref.token_ids and state.text == ref.text
            assert await redis.xrange(names.stream_key(finished.request_id)) == before
            # The original 17 events were kept, not rewritten.
            events = await read_events(redis, names, partial.request_id)
            assert [(e.text, e.token_ids) for e in events[:17]] == [(t, i) for t, i in ref.deltas[:17]]
            # The engine had started each of them before their stream state was read; every early start the
            # state overruled was withdrawn, leaving nothing running and no KV block held.
            await wait_idle_heartbeat(redis, names)
    finally:
        await redis.aclose()


async def test_a_worker_whose_engine_process_dies_stops_and_another_finishes_its_request(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, engine: AsyncEngine, unique_prefix: str
) -> None:
    max_tokens = 400
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    ref = await reference_run(
        engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    request = request_for(max_tokens)
    try:
        async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, engine_mode="process") as first:
            engines = _engine_processes()
            assert len(engines) == 1, f"expected one engine process under this test, found {engines}"
            await publish(first, request)
            deadline = time.monotonic() + 30
            while len(await read_events(redis, names, request.request_id)) < 5:
                assert time.monotonic() < deadline, "the request never started streaming"
                await asyncio.sleep(0.01)
            os.kill(engines[0], signal.SIGKILL)
            # The fetch loop (a failed stream) or the heartbeat (a dead engine) notices first, whichever runs
            # first on a busy box; either way the worker stops without committing the request.
            with pytest.raises(RuntimeError, match=r"the engine (failed|stopped); stopping this worker"):
                await asyncio.wait_for(first.task, 30)
            cut = await read_events(redis, names, request.request_id)
            assert cut[-1].type == "token", "the request finished before its engine was killed"
            # Nothing was committed for the unfinished request: the next worker continues it exactly once.
            async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, engine_mode="thread"):
                assert_exactly_once(await wait_terminal(redis, names, request.request_id), ref)
    finally:
        await redis.aclose()


async def test_an_idle_worker_whose_engine_process_dies_stops_and_leaves_the_heartbeats(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, unique_prefix: str
) -> None:
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, engine_mode="process") as worker:
        (engine_pid,) = _engine_processes()
        os.kill(engine_pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="the engine stopped; stopping this worker"):
            await asyncio.wait_for(worker.task, 10)
        assert await worker.redis.hget(worker.names.workers_key(MODEL), worker.settings.worker_id) is None


def _engine_processes() -> list[int]:
    """Pids of this process's children that run the engine's process entry point."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"gpu_workers.engine.entrypoints.process_main" in cmdline:
            found.append(int(entry.name))
    return found


async def test_a_cancel_heard_only_on_the_control_topic_keeps_a_request_from_starting(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, unique_prefix: str
) -> None:
    # What ingress sends when Redis refused a published request's record: no cancel marker in Redis, only the
    # control message, which reaches the worker before the request does.
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    dropped, served = request_for(30), request_for(4)
    try:
        async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix) as worker:
            producer = create_producer(worker.settings)
            await producer.start()
            try:
                cancel = CancelRequest(request_id=dropped.request_id, tenant="default", reason="record_failed")
                await producer.send_and_wait(names.control_topic, cancel.model_dump_json().encode())
            finally:
                await producer.stop()
            await asyncio.sleep(1.0)  # the control consumer polls continuously; give it the message first
            await publish(worker, dropped, served)
            events = await wait_terminal(redis, names, dropped.request_id)
            assert [e.type for e in events] == ["done"]
            assert isinstance(events[0], DoneEvent) and events[0].finish_reason == "abort"
            assert events[0].usage.completion_tokens == 0
            assert [e.type for e in await wait_terminal(redis, names, served.request_id)][-1] == "done"
            await wait_idle_heartbeat(redis, names)
    finally:
        await redis.aclose()


async def _wait_tokens(redis: Redis, names: Names, request_id: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(e.type == "token" for e in await read_events(redis, names, request_id)):
        assert time.monotonic() < deadline, f"{request_id} streamed no token within {timeout_s}s"
        await asyncio.sleep(0.02)


async def test_a_request_whose_reader_lease_lapsed_stops_and_the_others_run_on(
    kafka_bootstrap: str, redis_url: str, paced_model_dir: Path, unique_prefix: str
) -> None:
    # Ingress relays an OpenAI-style request's output to its HTTP client and cancels it when the client leaves;
    # when that ingress dies nobody cancels, so the worker stops the requests whose ingress's lease lapsed.
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    dead, alive = f"dead-{unique_prefix}", f"alive-{unique_prefix}"
    orphan = request_for(1500).model_copy(update={"reader": dead})
    relayed = request_for(40).model_copy(update={"reader": alive})
    native = request_for(40)  # no reader: its client resumes from the stream, it is never stopped for one
    try:
        await redis.set(names.reader_key(dead), "ingress 1", px=60_000)
        await redis.set(names.reader_key(alive), "ingress 2", px=60_000)
        async with running_worker(
            kafka_bootstrap, redis_url, paced_model_dir, unique_prefix, reader_lease_s=1.5, max_num_seqs=4
        ) as worker:
            await publish(worker, orphan, relayed, native)
            await _wait_tokens(redis, names, orphan.request_id)
            await redis.delete(names.reader_key(dead))  # the ingress relaying the orphan died
            events = await wait_terminal(redis, names, orphan.request_id, timeout_s=30)
            done = events[-1]
            assert isinstance(done, DoneEvent) and done.finish_reason == "abort"
            assert 0 < done.usage.completion_tokens < 1500
            # A request of that ingress still queued (a backlog behind it) is never started.
            queued = request_for(1500).model_copy(update={"reader": dead})
            await publish(worker, queued)
            (never,) = await wait_terminal(redis, names, queued.request_id, timeout_s=30)
            assert isinstance(never, DoneEvent) and never.finish_reason == "abort"
            assert never.usage.completion_tokens == 0
            # The same ingress renews its lease after all (Redis was out of its reach): a request it sends at once
            # runs, though the watch's next check (half a second apart here) has not seen the lease back yet.
            await redis.set(names.reader_key(dead), "ingress 1 again", px=60_000)
            revived = request_for(20).model_copy(update={"reader": dead})
            await publish(worker, revived)
            last = (await wait_terminal(redis, names, revived.request_id))[-1]
            assert isinstance(last, DoneEvent) and last.finish_reason == "length", last
            for kept in (relayed, native):
                last = (await wait_terminal(redis, names, kept.request_id))[-1]
                assert isinstance(last, DoneEvent) and last.finish_reason == "length"
                assert last.usage.completion_tokens == 40
            await wait_idle_heartbeat(redis, names)
    finally:
        await redis.delete(names.reader_key(dead), names.reader_key(alive))
        await redis.aclose()


class _Aborts:
    """The engine's abort, recorded: all the reader watch asks of an engine."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def test_a_reader_lease_missing_at_one_check_only_stops_nothing(
    redis_url: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Redis that restarted empty (or failed over ahead of a renewal) loses the lease until ingress renews it,
    # within a third of the lease: checks in between stop nothing; missing at every check over half the lease does.
    names = Names(unique_prefix)
    redis = Redis.from_url(redis_url)
    in_flight, engine = InFlight(), _Aborts()
    # A 0.3 s lease: a lapse is a lease missing at every check over 0.15 s.
    watch = ReaderWatch(redis, names, in_flight, Cancels(None, engine, in_flight), lease_s=0.3)  # type: ignore[arg-type]
    entry = in_flight.take(TopicPartition("t", 0), 0, "interactive")
    assert in_flight.claim_at_once(entry, "rid-1")
    entry.reader = "ingress-a"
    no_reader = in_flight.take(TopicPartition("t", 0), 1, "interactive")  # a native request: never stopped
    assert in_flight.claim_at_once(no_reader, "rid-2")
    key = names.reader_key("ingress-a")
    try:
        assert await watch.check() == []  # first miss
        await redis.set(key, "renewed", px=3000)
        assert await watch.check() == []  # back: the miss is forgotten
        await redis.delete(key)
        assert await watch.check() == []  # a first miss again
        assert await watch.check() == []  # a second, too soon: a renewal may still be on its way
        assert engine.aborted == [] and not entry.cancelled
        await asyncio.sleep(0.2)
        assert await watch.check() == ["rid-1"]  # missing at every check over half the lease
        assert entry.cancelled and engine.aborted == ["rid-1"] and not no_reader.cancelled
        assert await watch.check() == [] and engine.aborted == ["rid-1"]  # stopped once
        # Its requests still queued never start: refused before the early start and at pick-up.
        later = in_flight.take(TopicPartition("t", 0), 2, "interactive")
        assert in_flight.claim_at_once(later, "rid-3")
        later.reader = "ingress-a"
        assert watch._cancels.pending("rid-3", "ingress-a") and watch._cancels.requested(later, False)
        # The same ingress renewed its lease after all (a partition healed): its requests run again.
        await redis.set(key, "renewed", px=3000)
        assert await watch.check() == [] and not watch._cancels.pending("rid-4", "ingress-a")
        # A dead ingress's id never comes back (a restarted one has a new id): it is forgotten after a while.
        watch._cancels.reader_gone("ingress-dead")
        assert watch._cancels.gone_readers == ["ingress-dead"]
        monkeypatch.setattr(control, "GONE_READERS_KEPT_S", -1.0)
        assert watch._cancels.gone_readers == [] and not watch._cancels.reader_is_gone("ingress-dead")
        # A dead reader's short requests, with gaps between them: its run of misses is kept across the gaps.
        short = in_flight.take(TopicPartition("t", 0), 5, "interactive")
        assert in_flight.claim_at_once(short, "rid-5")
        short.reader = "ingress-b"
        assert await watch.check() == []  # its first miss
        in_flight.release(short)  # it ended before the next check
        assert await watch.check() == []  # not asked now
        await asyncio.sleep(0.2)
        following = in_flight.take(TopicPartition("t", 0), 6, "interactive")
        assert in_flight.claim_at_once(following, "rid-6")
        following.reader = "ingress-b"
        assert await watch.check() == ["rid-6"]  # missing since the first check, over half the lease
    finally:
        await redis.delete(key)
        await redis.aclose()


def append_retries(caplog: pytest.LogCaptureFixture) -> int:
    """How many times the worker's appender has logged a failed append (and gone on retrying)."""
    return sum("redis append failed" in r.getMessage() for r in caplog.records)


async def test_worker_rides_out_redis_restarts(
    kafka_bootstrap: str,
    model_dir: Path,
    engine: AsyncEngine,
    tmp_path: Path,
    unique_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis killed (SIGKILL) mid-generation and restarted: with appendonly + fsync always nothing is lost
    (every stream complete, contiguous, equal to the uninterrupted output); heartbeats resume."""
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    max_tokens = 600
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    ref = await reference_run(
        engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    requests = [request_for(max_tokens) for _ in range(3)]
    try:
        async with running_worker(kafka_bootstrap, server.url, model_dir, unique_prefix) as worker:
            await publish(worker, *requests)
            names, redis = worker.names, worker.redis
            deadline = time.monotonic() + 30
            while not await redis.exists(names.stream_key(requests[-1].request_id)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            before_kill = {r.request_id: len(await read_events(redis, names, r.request_id)) for r in requests}
            server.kill()
            killed = time.monotonic()
            # Down until the worker's own retry loop has met the outage: redis-py first retries each command
            # (and each reconnect inside it) itself, which alone rides out a couple of seconds, so a fixed short
            # outage may never reach the appender and would test nothing of it.
            while not append_retries(caplog):
                assert time.monotonic() - killed < 30, "the worker never retried an append while Redis was down"
                await asyncio.sleep(0.05)
            server.start()
            restarted, outage = time.time(), time.monotonic() - killed
            streams = {r.request_id: await wait_terminal(redis, names, r.request_id) for r in requests}
            for events in streams.values():
                assert_exactly_once(events, ref)
            # Redis was killed mid-generation: every request had streamed some, not all, of its tokens.
            assert all(0 < n < max_tokens for n in before_kill.values()), before_kill
            await wait_heartbeat_after(redis, names, restarted)
            retries = append_retries(caplog)
            fault_report(
                "redis_restart_appendonly",
                count_events(
                    {rid: [e.seq for e in events] for rid, events in streams.items()},
                    {rid: events[-1].seq for rid, events in streams.items()},
                ),
                requests=len(requests),
                tokens_each=max_tokens,
                events_before_kill=sorted(before_kill.values()),
                outage_s=round(outage, 2),
                append_retries=retries,
            )
    finally:
        with contextlib.suppress(Exception):
            server.kill()


async def test_worker_keeps_publishing_after_redis_restart_without_persistence(
    kafka_bootstrap: str, model_dir: Path, engine: AsyncEngine, tmp_path: Path, unique_prefix: str
) -> None:
    """Without persistence a restarted Redis has lost the streams' heads (Redis's own durability), but the
    worker goes on: in-flight streams get their remaining events and ``done``, and new requests are served."""
    server = RedisServer(tmp_path, appendonly=False)
    server.start()
    max_tokens = 600
    prompt_ids = list(engine.tokenizer.encode(PROMPT))
    ref = await reference_run(
        engine, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    in_flight = [request_for(max_tokens) for _ in range(2)]
    try:
        async with running_worker(kafka_bootstrap, server.url, model_dir, unique_prefix) as worker:
            names, redis = worker.names, worker.redis
            await publish(worker, *in_flight)
            deadline = time.monotonic() + 30
            while not await redis.exists(names.stream_key(in_flight[-1].request_id)):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            before_kill = [len(await read_events(redis, names, r.request_id)) for r in in_flight]
            assert all(n < max_tokens for n in before_kill)
            server.kill()
            await asyncio.sleep(1.0)
            server.start()
            restarted = time.time()
            lost_heads = []
            for request in in_flight:
                events = await wait_terminal(redis, names, request.request_id)
                # What survived is the tail written after the restart: contiguous, one done, seqs as before.
                assert events[0].seq > 0, "the restart without persistence should have lost the stream's head"
                assert [e.seq for e in events] == list(range(events[0].seq, events[-1].seq + 1))
                assert [e.type for e in events].count("done") == 1
                assert events[-1].seq == len(ref.deltas)
                lost_heads.append(events[0].seq)
            after = request_for(max_tokens)
            await publish(worker, after)
            assert_exactly_once(await wait_terminal(redis, names, after.request_id), ref)
            await wait_heartbeat_after(redis, names, restarted)
            report(
                "redis_restart_no_persistence",
                in_flight=len(in_flight),
                events_lost_by_redis=lost_heads,
                tails_contiguous=True,
                served_after_restart=1,
            )
    finally:
        with contextlib.suppress(Exception):
            server.kill()


async def test_batch_lines_are_paced_while_an_interactive_request_was_taken_lately(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, unique_prefix: str
) -> None:
    """An interactive request taken within the busy window makes the batch tier start at most
    ``worker_batch_rate_busy`` requests a second: 9 one-token lines at 4 a second need at least 2 s from their
    publishing to the last one's end (unpaced, this worker ends them in a small fraction of that)."""
    overrides: dict[str, Any] = {"worker_batch_rate_busy": 4.0, "worker_busy_window_s": 120.0}
    async with running_worker(kafka_bootstrap, redis_url, model_dir, unique_prefix, **overrides) as worker:
        interactive = request_for(2).model_copy(update={"priority": "interactive"})
        await publish(worker, interactive, tier="interactive")
        await wait_terminal(worker.redis, worker.names, interactive.request_id)
        lines = [request_for(1).model_copy(update={"priority": "batch"}) for _ in range(9)]
        published = time.monotonic()
        await publish(worker, *lines, tier="batch")
        for line in lines:
            assert_exactly_once(await wait_terminal(worker.redis, worker.names, line.request_id))
        elapsed = time.monotonic() - published
        report("batch_paced", lines=len(lines), rate=4.0, elapsed_s=round(elapsed, 2))
        assert elapsed >= 2.0, f"9 batch lines ended {elapsed:.2f}s after publishing: not paced at 4 a second"


async def test_a_session_timeout_the_broker_refuses_stops_the_worker_with_a_clear_error(
    kafka_bootstrap: str, redis_url: str, model_dir: Path, unique_prefix: str
) -> None:
    # Above every broker's default group.max.session.timeout.ms (30 min).
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=unique_prefix,
        topic_partitions=1,
        model=str(model_dir),
        model_name=MODEL,
        kv_cache_gb=0.05,
        worker_session_timeout_ms=3_600_000,
    )
    with pytest.raises(RuntimeError, match="SLUICEGATE_WORKER_SESSION_TIMEOUT_MS"):
        await asyncio.wait_for(run_worker(settings, asyncio.Event()), 60)
