"""Worker crashes on the real pipeline: ``kill -9`` of the worker generating a request, with a second worker in
the group. The client must see a pause, not a restart: every token exactly once, the same text as an
uninterrupted run, over the WebSocket relay and over OpenAI server-sent events alike. A soak test kills and
restarts workers under steady load and audits every stream.

Each test prints a ``FAULT-REPORT`` line (run with ``-s``) with the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fault_report import count_events, count_text, fault_report
from websockets.asyncio.client import connect

from gpu_workers.engine import LLM, IncrementalDetokenizer, SamplingParams
from schemas import DoneEvent, FinalResult, Names, RestartEvent, TokenEvent
from sluicegate.dead_letter_admin import read_topic

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "Once upon a time in a land far away"
MAX_TOKENS = 300
WORKERS = ("worker-a", "worker-b")


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Generation must last long enough to kill a worker in the middle of it."""
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    # One intra-op thread per worker: several processes share two cores, and oversubscribed OpenMP threads
    # spin rather than compute.
    # The prompt-prefix key alone places requests: these tests need two concurrent same-prompt requests on one
    # worker, which cached-prefix routing would spread over both before either has cached the prompt.
    return {"OMP_NUM_THREADS": "1", "SLUICEGATE_KV_EVENTS": "false"}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    """The module's model in this process, one thread: the reference the pipeline's output is checked against."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(model=str(tiny_model_dir), device="cpu")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> str:
    """The uninterrupted greedy output, outside the pipeline."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return out[0].text


def ensure_workers(pipeline: Pipeline) -> None:
    """Both workers running and heartbeating since they (re)joined the group."""
    started = time.time()
    restarted = []
    for name in WORKERS:
        services = [s for s in pipeline.services if s.name == name]
        if not services or not services[-1].alive():
            pipeline.start_worker(name)
            restarted.append(name)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        beats = pipeline.heartbeats()
        fresh = [
            n
            for n in WORKERS
            if n in beats
            and beats[n].partitions
            and beats[n].sent_at.timestamp() > time.time() - 2
            and (n not in restarted or beats[n].sent_at.timestamp() > started)
        ]
        if len(fresh) == len(WORKERS) and sum(len(beats[n].partitions) for n in WORKERS) == 6:
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not ready: {pipeline.heartbeats()}")


def wait_heartbeat_since(pipeline: Pipeline, worker_id: str, since: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = pipeline.heartbeats().get(worker_id)
        if beat is not None and beat.sent_at.timestamp() > since:
            return
        time.sleep(0.1)
    raise AssertionError(f"{worker_id} did not come back")


def wait_owner(pipeline: Pipeline, request_id: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = pipeline.record(request_id)
        if record is not None and record.status == "running" and record.worker_id:
            return str(record.worker_id)
        time.sleep(0.02)
    raise AssertionError(f"no worker took {request_id}")


def max_gap(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


class SseClient(threading.Thread):
    """An OpenAI streaming completion read on its own thread: text pieces with arrival times."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__(daemon=True)
        self.pipeline = pipeline
        self.request_id: str | None = None
        self.pieces: list[str] = []
        self.times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "model": self.pipeline.model,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        url = f"{self.pipeline.ingress_url}/v1/completions"
        try:
            with httpx.stream("POST", url, json=body, headers=self.pipeline.headers(), timeout=120) as response:
                response.raise_for_status()
                self.request_id = response.headers["x-request-id"]
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        self.error = json.dumps(chunk)
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    if chunk.get("choices") and chunk["choices"][0]["text"]:
                        self.pieces.append(chunk["choices"][0]["text"])
                        self.times.append(time.monotonic())
        except Exception as exc:  # reported by the test
            self.error = repr(exc)


async def test_killed_worker_is_a_pause_for_websocket_and_openai_streaming_clients(
    pipeline: Pipeline, reference: str
) -> None:
    """One request relayed over WebSocket (result service) and one over OpenAI SSE (ingress), with the same
    prompt so prefix affinity puts them on the same partition; their worker is killed mid-generation."""
    ensure_workers(pipeline)
    sse = SseClient(pipeline)
    sse.start()
    accepted = pipeline.submit(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    rid = accepted["request_id"]
    events: list[dict[str, Any]] = []
    times: list[float] = []
    killed: tuple[str, int, int] | None = None
    async with connect(f"{accepted['stream_url']}?token={accepted['stream_token']}", open_timeout=10) as ws:
        async for message in ws:
            event = json.loads(message)
            events.append(event)
            times.append(time.monotonic())
            if killed is None and event["type"] == "token" and event["seq"] >= 40 and sse.request_id:
                owner = wait_owner(pipeline, rid)
                assert wait_owner(pipeline, sse.request_id) == owner, "prefix affinity should co-locate them"
                pipeline.kill(pipeline.find(owner))
                delivered = (len(pipeline.stream_events(rid)), len(pipeline.stream_events(sse.request_id)))
                killed = (owner, *delivered)
            if event["type"] in ("done", "error"):
                break
    sse.join(timeout=60)
    assert killed is not None, "the request finished before its worker could be killed"
    owner, ws_delivered, sse_delivered = killed
    assert max(ws_delivered, sse_delivered) < MAX_TOKENS - 50, "the worker was not killed mid-generation"

    # WebSocket: every event once, in order, no restart, the uninterrupted text.
    assert [e["seq"] for e in events] == list(range(len(events))), "gap or duplicate"
    assert [e["type"] for e in events].count("done") == 1 and events[-1]["type"] == "done"
    assert "restart" not in {e["type"] for e in events}
    assert "".join(e.get("text", "") for e in events) == reference
    tokens = sum(len(e["token_ids"]) for e in events if e["type"] == "token")
    assert tokens == MAX_TOKENS == events[-1]["usage"]["completion_tokens"]
    # OpenAI SSE through ingress: the same.
    assert sse.error is None, sse.error
    assert "".join(sse.pieces) == reference
    assert sse.usage is not None and sse.usage["completion_tokens"] == MAX_TOKENS
    assert sse.request_id is not None
    sse_events = pipeline.stream_events(sse.request_id)
    assert [e.seq for e in sse_events] == list(range(len(sse_events)))
    # Another worker finished both.
    assert pipeline.record(rid).worker_id != owner
    assert pipeline.record(sse.request_id).worker_id != owner
    fault_report(
        "kill9_mid_generation",
        {
            # The WebSocket client's events against its stream (seq 0..done); the SSE client's text (characters).
            "websocket": count_events({rid: [e["seq"] for e in events]}, {rid: pipeline.stream_events(rid)[-1].seq}),
            "openai_sse": count_text("".join(sse.pieces), reference),
        },
        requests=2,
        tokens_each=MAX_TOKENS,
        killed_after_events={"websocket": ws_delivered, "openai_sse": sse_delivered},
        pause_s={"websocket": round(max_gap(times), 2), "openai_sse": round(max_gap(sse.times), 2)},
        restarts=sum(e["type"] == "restart" for e in events),
    )


# --- soak ------------------------------------------------------------------------------------------------------

SOAK_PROMPTS = ["The river ran quietly", "A message queue carries requests", "She asked what time the train"]
SOAK_MAX_TOKENS = 120


def expected_text(llm: LLM, prompt: str, tokens: list[int]) -> str:
    """What an uninterrupted run streams for these tokens: the engine's incremental detokenizer, flushed."""
    tokenizer = llm.engine.tokenizer
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), True, frozenset(tokenizer.all_special_ids))
    return "".join(detok.step(t) for t in tokens) + detok.flush()


def read_results(pipeline: Pipeline, request_ids: set[str]) -> dict[str, list[FinalResult]]:
    """Every final result on ``llm.results`` for the given requests."""
    records = asyncio.run(read_topic(pipeline.kafka_bootstrap, Names(pipeline.prefix).results_topic))
    out: dict[str, list[FinalResult]] = {}
    for record in records:
        result = FinalResult.model_validate_json(record.value)
        if result.request_id in request_ids:
            out.setdefault(result.request_id, []).append(result)
    return out


def test_soak_kill_and_restart_workers_under_load(pipeline: Pipeline, llm: LLM) -> None:
    """About 30 s of steady load while a worker is killed (SIGKILL) and restarted every ~6-8 s; then every
    accepted request must have finished exactly once with a complete, gap-free, duplicate-free stream."""
    ensure_workers(pipeline)
    resumed_before = count_in_worker_logs(pipeline, "worker.resuming")
    refs = {
        p: o.token_ids
        for p, o in zip(
            SOAK_PROMPTS,
            llm.generate(SOAK_PROMPTS, SamplingParams(temperature=0.0, max_tokens=SOAK_MAX_TOKENS, ignore_eos=True)),
            strict=True,
        )
    }
    rng = random.Random(7)
    accepted: dict[str, tuple[str, int]] = {}
    stop = threading.Event()
    errors: list[str] = []

    def load() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                prompt, max_tokens = rng.choice(SOAK_PROMPTS), rng.randint(20, SOAK_MAX_TOKENS)
                body = {
                    "model": pipeline.model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                try:
                    response = client.post(f"{pipeline.ingress_url}/v1/requests", json=body, headers=pipeline.headers())
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                    continue
                if response.status_code == 202:
                    accepted[response.json()["request_id"]] = (prompt, max_tokens)
                else:
                    errors.append(f"{response.status_code} {response.json().get('error', {}).get('code')}")
                stop.wait(0.25)

    loader = threading.Thread(target=load, daemon=True)
    started = time.monotonic()
    loader.start()
    kills = 0
    try:
        next_kill = time.monotonic() + 3
        for round_ in range(4):
            time.sleep(max(0.0, next_kill - time.monotonic()))
            victim = pipeline.find(WORKERS[round_ % 2])
            pipeline.kill(victim)
            kills += 1
            restarted_at = time.time()
            pipeline.start_worker(victim.name)
            next_kill = time.monotonic() + 6
            # The other worker is only killed once this one is up again (heartbeating, joined or still
            # joining), so the model always has a live worker: no request is refused meanwhile.
            wait_heartbeat_since(pipeline, victim.name, restarted_at)
    finally:
        stop.set()
        loader.join(timeout=30)
    load_s = time.monotonic() - started
    ensure_workers(pipeline)

    deadline = time.monotonic() + 120
    pending = set(accepted)
    while pending and time.monotonic() < deadline:
        pending = {
            rid for rid in pending if not (ev := pipeline.stream_events(rid)) or ev[-1].type not in ("done", "error")
        }
        time.sleep(0.5)
    assert not pending, f"{len(pending)} accepted requests never finished"
    assert not errors, f"submissions refused while a worker was up: {collections.Counter(errors)}"
    drained_s = time.monotonic() - started - load_s

    tokens_total = 0
    streams = {rid: pipeline.stream_events(rid) for rid in accepted}
    for rid, (prompt, max_tokens) in accepted.items():
        events = streams[rid]
        assert [e.seq for e in events] == list(range(len(events))), f"{rid}: gap or duplicate"
        assert [e.type for e in events].count("done") == 1 and events[-1].type == "done", f"{rid}: {events[-1]}"
        assert not any(isinstance(e, RestartEvent) for e in events)
        tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
        done = events[-1]
        assert isinstance(done, DoneEvent)
        assert done.usage.completion_tokens == len(tokens) == max_tokens, rid
        assert tokens == refs[prompt][:max_tokens], f"{rid}: tokens differ from the uninterrupted run"
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        assert text == expected_text(llm, prompt, tokens), f"{rid}: text differs from the uninterrupted run"
        tokens_total += len(tokens)
    results = read_results(pipeline, set(accepted))
    missing = set(accepted) - set(results)
    assert not missing, f"{len(missing)} requests without a final result on llm.results"
    for rid, copies in results.items():
        assert len({(r.text, tuple(r.token_ids)) for r in copies}) == 1, f"{rid}: conflicting final results"
    fault_report(
        "soak_kill9_restart",
        count_events(
            {rid: [e.seq for e in events] for rid, events in streams.items()},
            {rid: events[-1].seq for rid, events in streams.items()},
        ),
        load_s=round(load_s, 1),
        drain_s=round(drained_s, 1),
        kills=kills,
        accepted=len(accepted),
        refused_submits=dict(collections.Counter(errors)),
        finished=len(accepted),
        tokens=tokens_total,
        duplicate_final_results=sum(len(c) - 1 for c in results.values()),
        resumed_mid_stream=count_in_worker_logs(pipeline, "worker.resuming") - resumed_before,
    )


def count_in_worker_logs(pipeline: Pipeline, needle: str) -> int:
    return sum(
        path.read_text(errors="replace").count(needle)
        for path in {s.log_path for s in pipeline.services}
        if path.name.startswith("worker")
    )
