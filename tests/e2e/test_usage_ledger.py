"""The usage ledger end to end: a mixed run through every path a request can take (OpenAI chat and streaming
completions, a response-cache hit, native requests, a cancel, Kafka-native records including one the engine
refuses, batch lines) while the worker generating one request is killed (``kill -9``) and another finishes it.
The rollup's totals (``GET /v1/usage``, ``sluicegate usage``) must equal the sum of the usage the clients were
given, request for request, and stay equal when the ledger carries duplicates (as a worker that takes a request
over sends its record again).
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition

from ingress.auth import derived_tenant, hash_key
from schemas import DoneEvent, ErrorEvent, FinalResult, InferenceRequest, Names, SamplingOptions, UsageRecord
from sluicegate.dead_letter_admin import read_topic
from sluicegate.kafka import create_admin, create_consumer, create_producer

from .batch_support import TERMINAL, chat_line
from .conftest import API_KEY, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

TENANT = derived_tenant(hash_key(API_KEY))
KILLED_TOKENS = 200


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Generation must last long enough to kill a worker in the middle of it."""
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "SLUICEGATE_RESPONSE_CACHE_TTL_S": "600",
        "SLUICEGATE_BATCH_TICK_S": "0.5",
        "SLUICEGATE_BATCH_STALL_CHECK_S": "2",
    }


class Ledger:
    """What the clients were told: each request's usage (prompt, completion, cached reply or not) and outcome."""

    def __init__(self) -> None:
        self.usage: dict[str, tuple[int, int, bool]] = {}
        self.outcomes: dict[str, str] = {}

    def add(self, request_id: str, usage: dict[str, Any] | None, outcome: str) -> None:
        assert request_id not in self.usage, request_id
        if usage is None:
            self.usage[request_id] = (0, 0, False)
        else:
            self.usage[request_id] = (usage["prompt_tokens"], usage["completion_tokens"], bool(usage.get("cached")))
        self.outcomes[request_id] = outcome

    def totals(self) -> dict[str, int]:
        outcomes = collections.Counter(self.outcomes.values())
        return {
            "requests": len(self.usage),
            "prompt_tokens": sum(p for p, _, _ in self.usage.values()),
            "output_tokens": sum(c for _, c, _ in self.usage.values()),
            "total_tokens": sum(p + c for p, c, _ in self.usage.values()),
            "finished": outcomes["finished"],
            "cancelled": outcomes["cancelled"],
            "failed": outcomes["failed"],
            "response_cache": sum(hit for _, _, hit in self.usage.values()),
        }


def wait_tokens(pipeline: Pipeline, request_id: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(pipeline.stream_events(request_id)) < count:
        assert time.monotonic() < deadline, f"{request_id}: fewer than {count} events"
        time.sleep(0.02)


def native(pipeline: Pipeline, ledger: Ledger, *, cancel: bool = False, **body: Any) -> str:
    """A native request followed to its end in its stream (cancelled after a few tokens with ``cancel``)."""
    rid = pipeline.submit(prompt="A native request about rivers", temperature=0, **body)["request_id"]
    if cancel:
        wait_tokens(pipeline, rid, 3)
        httpx.delete(f"{pipeline.ingress_url}/v1/requests/{rid}", headers=pipeline.headers(), timeout=10)
    done = pipeline.wait_stream_end(rid, timeout_s=120)[-1]
    assert isinstance(done, DoneEvent), done
    ledger.add(rid, done.usage.model_dump(), "cancelled" if cancel else "finished")
    return rid


def kill_mid_request(pipeline: Pipeline, ledger: Ledger) -> tuple[str, str]:
    """A long native request whose worker is killed mid-generation; the other worker finishes it."""
    accepted = pipeline.submit(prompt="Once upon a time", max_tokens=KILLED_TOKENS, temperature=0, ignore_eos=True)
    rid = accepted["request_id"]
    wait_tokens(pipeline, rid, 20)
    record = pipeline.record(rid)
    assert record is not None and record.worker_id, record
    owner = str(record.worker_id)
    pipeline.kill(pipeline.find(owner))
    assert len(pipeline.stream_events(rid)) < KILLED_TOKENS - 20, "the worker was not killed mid-generation"
    done = pipeline.wait_stream_end(rid, timeout_s=180)[-1]
    assert isinstance(done, DoneEvent) and done.usage.completion_tokens == KILLED_TOKENS, done
    assert pipeline.record(rid).worker_id != owner
    ledger.add(rid, done.usage.model_dump(), "finished")
    return rid, owner


def openai_calls(pipeline: Pipeline, ledger: Ledger) -> None:
    """A chat completion repeated until the response cache answers it, and a streamed completion."""
    chat = {
        "model": pipeline.model,
        "messages": [{"role": "user", "content": "Name a river."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    for _ in range(20):
        response = httpx.post(f"{pipeline.ingress_url}/v1/chat/completions", json=chat, headers=pipeline.headers())
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        ledger.add(response.headers["x-request-id"], usage, "finished")
        if usage.get("cached"):
            break
        time.sleep(0.3)  # the reply is stored once its stream ended (a background fill)
    else:
        raise AssertionError("the response cache never answered")
    client = pipeline.openai(max_retries=0)
    stream = client.completions.create(
        model=pipeline.model,
        prompt="Streams carry",
        max_tokens=7,
        temperature=0.5,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage, request_id = None, None
    for chunk in stream:
        request_id = chunk.id.removeprefix("cmpl-")
        usage = chunk.usage or usage
    assert usage is not None and request_id is not None
    ledger.add(request_id, usage.model_dump(), "finished")


def kafka_native(pipeline: Pipeline, ledger: Ledger) -> None:
    """One Kafka-native record served, one the engine refuses (prompt + max_tokens over the context)."""
    served = InferenceRequest(
        request_id=f"kn-{uuid.uuid4().hex[:8]}",
        model=pipeline.model,
        prompt="Kafka-native",
        tenant=TENANT,
        sampling=SamplingOptions(max_tokens=5, temperature=0),
    )
    refused = served.model_copy(
        update={"request_id": f"kn-{uuid.uuid4().hex[:8]}", "sampling": SamplingOptions(max_tokens=100_000)}
    )

    async def send() -> None:
        producer = create_producer(bootstrap=pipeline.kafka_bootstrap)
        await producer.start()
        try:
            for request in (served, refused):
                await producer.send_and_wait(Names(pipeline.prefix).inbound_topic, request.model_dump_json().encode())
        finally:
            await producer.stop()

    asyncio.run(send())
    done = pipeline.wait_stream_end(served.request_id, timeout_s=120)[-1]
    assert isinstance(done, DoneEvent)
    ledger.add(served.request_id, done.usage.model_dump(), "finished")
    error = pipeline.wait_stream_end(refused.request_id, timeout_s=120)[-1]
    assert isinstance(error, ErrorEvent) and error.code == "context_length_exceeded", error
    ledger.add(refused.request_id, None, "failed")
    # A consumer of llm.results hears of the failure there too, not only on the stream.
    deadline = time.monotonic() + 30
    while True:
        records = asyncio.run(read_topic(pipeline.kafka_bootstrap, Names(pipeline.prefix).results_topic))
        results = [FinalResult.model_validate_json(r.value) for r in records]
        failed = [r for r in results if r.request_id == refused.request_id]
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(r.finish_reason, r.error_code, r.text) for r in failed] == [("error", "context_length_exceeded", "")]


def batch(pipeline: Pipeline, ledger: Ledger) -> None:
    """Two batch lines through the Batch API; their usage is in the output file's bodies."""
    client = pipeline.openai(max_retries=0)
    lines = [chat_line(f"line-{n}", pipeline.model, max_tokens=4) for n in range(2)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while (current := client.batches.retrieve(created.id)).status not in TERMINAL:
        assert time.monotonic() < deadline, current
        time.sleep(0.5)
    assert current.status == "completed" and current.output_file_id, current
    for raw in client.files.content(current.output_file_id).text.splitlines():
        response = json.loads(raw)["response"]
        ledger.add(response["request_id"], response["body"]["usage"], "finished")


def usage_records(pipeline: Pipeline) -> dict[str, list[UsageRecord]]:
    records = asyncio.run(read_topic(pipeline.kafka_bootstrap, Names(pipeline.prefix).usage_topic))
    by_request: dict[str, list[UsageRecord]] = collections.defaultdict(list)
    for record in records:
        parsed = UsageRecord.model_validate_json(record.value)
        by_request[parsed.request_id].append(parsed)
    return by_request


def rollup_caught_up(pipeline: Pipeline) -> bool:
    """Whether the rollup's group has committed up to the end of every partition of the ledger."""
    names = Names(pipeline.prefix)

    async def check() -> bool:
        admin = create_admin(bootstrap=pipeline.kafka_bootstrap)
        await admin.start()
        try:
            (info,) = await admin.describe_topics([names.usage_topic])
            committed = await admin.list_consumer_group_offsets(f"{names.prefix}sluicegate-usage")
        finally:
            await admin.close()
        parts = [TopicPartition(names.usage_topic, p["partition"]) for p in info["partitions"]]
        consumer = create_consumer(group_id=None, bootstrap=pipeline.kafka_bootstrap)
        await consumer.start()
        try:
            ends = await consumer.end_offsets(parts)
        finally:
            await consumer.stop()
        done = [ends[tp] == 0 or (tp in committed and committed[tp].offset >= ends[tp]) for tp in parts]
        return bool(parts) and all(done)

    return asyncio.run(check())


def rolled_up(pipeline: Pipeline, expected: dict[str, int], timeout_s: float = 90) -> dict[str, Any]:
    """``GET /v1/usage`` once its totals count every expected request and the rollup read the whole ledger."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{pipeline.ingress_url}/v1/usage", headers=pipeline.headers(), timeout=10).json()
        if body["totals"]["requests"] >= expected["requests"] and rollup_caught_up(pipeline):
            return body
        assert time.monotonic() < deadline, f"rollup behind: {body['totals']} vs {expected}"
        time.sleep(0.5)


def test_ledger_totals_equal_the_usage_clients_were_given_across_a_mixed_run_with_a_worker_kill(
    pipeline: Pipeline,
) -> None:
    pipeline.start_worker("worker-b")
    pipeline.wait_workers(2)
    pipeline.start_batch_worker()
    ledger = Ledger()
    killed, owner = kill_mid_request(pipeline, ledger)
    openai_calls(pipeline, ledger)
    native(pipeline, ledger, max_tokens=5)
    native(pipeline, ledger, cancel=True, max_tokens=KILLED_TOKENS, ignore_eos=True)
    kafka_native(pipeline, ledger)
    batch(pipeline, ledger)
    expected = ledger.totals()
    assert expected["cancelled"] == expected["failed"] == expected["response_cache"] == 1

    body = rolled_up(pipeline, expected)
    assert {k: body["totals"][k] for k in expected} == expected
    # The ledger itself: a record for every request and nothing else; copies of one agree on the tokens.
    records = usage_records(pipeline)
    assert set(records) == set(ledger.usage)
    for rid, copies in records.items():
        assert len({(r.prompt_tokens, r.output_tokens, r.outcome) for r in copies}) == 1, copies
        assert (copies[0].prompt_tokens, copies[0].output_tokens) == ledger.usage[rid][:2], rid
    assert all(r.producer != owner for r in records[killed]), "the killed worker ended its request?"
    for rid, copies in records.items():  # the API key's id, except on Kafka-native records (no key)
        assert {r.key_id for r in copies} == {None if rid.startswith("kn-") else hash_key(API_KEY)[:16]}, rid

    # Duplicates on the ledger (a worker that took a request over sends its record again): counted once.
    async def duplicate() -> None:
        producer = create_producer(bootstrap=pipeline.kafka_bootstrap)
        await producer.start()
        try:
            for rid in (killed, *list(records)[:3]):
                value = records[rid][0].model_dump_json().encode()
                await producer.send_and_wait(Names(pipeline.prefix).usage_topic, value, key=rid.encode())
        finally:
            await producer.stop()

    asyncio.run(duplicate())
    again = rolled_up(pipeline, expected)
    assert again["totals"] == body["totals"]
    copies = sum(len(rs) for rs in usage_records(pipeline).values())
    print("USAGE-LEDGER", json.dumps({"clients": expected, "rollup": again["totals"], "ledger_records": copies}))

    # The command line reads the same report.
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "usage", "--json", "--group-by", "model",
         "--base-url", f"{pipeline.ingress_url}/v1", "--api-key", API_KEY],
        env=pipeline.env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report["tenant"] == TENANT and report["totals"] == body["totals"]
    assert [row["model"] for row in report["data"]] == [pipeline.model]
