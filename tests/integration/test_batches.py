"""The Batch and Files API end to end with the official ``openai`` SDK: real ingress (uvicorn), real Kafka and
Redis, a real Celery batch worker process, and a fake GPU worker that answers through Redis streams and writes
``llm.results`` as the real one does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from batch_support import ResultsWorker, batch_worker, chat_line, jsonl, wait_status
from ingress_support import KEY, MODEL, heartbeat, running_ingress
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion
from redis.asyncio import Redis

from schemas import BatchOutputLine, Names
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

OTHER_KEY = "sk-other-tenant-key"
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture
def settings(test_settings: Settings, tmp_path: Path) -> Settings:
    keys = tmp_path / "keys.jsonl"
    keys.write_text(
        json.dumps({"key": KEY, "tenant": "acme"}) + "\n" + json.dumps({"key": OTHER_KEY, "tenant": "other"}) + "\n"
    )
    return test_settings.model_copy(
        update={
            "api_keys_file": keys,
            "stream_token_secret": "integration-secret",
            "topic_partitions": 2,
            "heartbeat_interval_s": 60.0,
            "state_dir": tmp_path / "state",
            "files_url": str(tmp_path / "files"),
            "batch_tick_s": 0.3,
            "batch_chunk_size": 2,
            "batch_stall_check_s": 1.0,
            "batch_cancel_grace_s": 3.0,
            "batch_max_file_bytes": 4096,
            "batch_max_lines": 8,
        }
    )


@pytest.fixture
async def ingress(settings: Settings, cleanup_topics: None) -> AsyncIterator[str]:
    async with running_ingress(settings) as url:
        yield url


def client(url: str, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def download(api: AsyncOpenAI, file_id: str | None) -> list[BatchOutputLine]:
    if file_id is None:
        return []
    content = await api.files.content(file_id)
    return [BatchOutputLine.model_validate_json(line) for line in content.text.splitlines()]


async def test_batch_runs_to_completion_with_error_lines(
    ingress: str, settings: Settings, redis: Redis, tmp_path: Path
) -> None:
    await heartbeat(redis, Names(settings.topic_prefix))
    lines = [chat_line(f"req-{n}", f"hello {n}") for n in range(4)]
    lines.append(chat_line("bad-body", "x", temperature=5))  # the online API answers 400
    lines.append(chat_line("fails-at-worker", "FAIL please"))
    # The fake model repeats the user's text: here a Hermes-style call of an offered tool.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    lines.append(chat_line("tool-call", call, tools=[WEATHER_TOOL], tool_choice="auto"))
    api = client(ingress)
    async with ResultsWorker(settings, redis):
        with batch_worker(settings, tmp_path / "batch-worker.log"):
            uploaded = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            assert (uploaded.purpose, uploaded.bytes) == ("batch", len(jsonl(lines)))
            batch = await api.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata={"job": "nightly"},
            )
            assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
            done = await wait_status(api, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 5, 2)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at
    output = await download(api, done.output_file_id)
    errors = await download(api, done.error_file_id)
    ids = [line.custom_id for line in output + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each custom_id exactly once
    assert [line.custom_id for line in output] == [*(f"req-{n}" for n in range(4)), "tool-call"]
    # The tool line's body is what the online API answers: the call parsed out, finish_reason tool_calls.
    tool_body = ChatCompletion.model_validate(output.pop().response.body)  # type: ignore[union-attr]
    (tool_choice,) = tool_body.choices
    assert tool_choice.finish_reason == "tool_calls" and tool_choice.message.content == "You said:"
    (tool_call,) = tool_choice.message.tool_calls or []
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    for n, line in enumerate(output):
        assert line.response is not None and line.response.status_code == 200 and line.error is None
        body = line.response.body
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": f"You said: hello {n}",
            "refusal": None,
        }
        assert body["usage"]["prompt_tokens"] == 7 and body["id"] == f"chatcmpl-{line.response.request_id}"
    # The batch's usage (as the SDK reads it) is the sum of the answered lines' (the failed ones ran no tokens).
    bodies = [line.response.body for line in output if line.response is not None] + [tool_body.model_dump()]
    assert done.usage is not None, done
    assert done.usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies) > 0
    assert done.usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    by_id = {line.custom_id: line for line in errors}
    bad = by_id["bad-body"].response
    assert bad is not None and bad.status_code == 400 and bad.body["error"]["param"] == "temperature"
    failed = by_id["fails-at-worker"].response
    assert failed is not None and failed.status_code == 400 and failed.body["error"]["code"] == "invalid_request"
    listed = await api.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]
    assert (await api.files.retrieve(done.output_file_id)).purpose == "batch_output"
    await api.close()


async def test_bad_uploads_and_batches_get_clear_errors(ingress: str, settings: Settings, redis: Redis) -> None:
    good = jsonl([chat_line("a", "hi"), chat_line("b", "there")])
    async with client(ingress) as api, client(ingress, OTHER_KEY) as other:
        with pytest.raises(openai.BadRequestError, match="purpose") as wrong_purpose:
            await api.files.create(file=("in.jsonl", good), purpose="fine-tune")
        assert wrong_purpose.value.code == "invalid_purpose"
        with pytest.raises(openai.BadRequestError, match="Line 3 is not valid JSON"):
            await api.files.create(file=("in.jsonl", good + b"not json\n"), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="Line 3 is not valid JSON: JSON nested too deeply"):
            await api.files.create(file=("in.jsonl", good + b"[" * 1100 + b"]" * 1100 + b"\n"), purpose="batch")
        dup = jsonl([chat_line("same", "1"), chat_line("x", "2"), chat_line("same", "3")])
        with pytest.raises(openai.BadRequestError, match="Line 3: custom_id 'same' is already used on line 1"):
            await api.files.create(file=("in.jsonl", dup), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="more than 8 lines"):
            await api.files.create(
                file=("in.jsonl", jsonl([chat_line(str(n), "x") for n in range(9)])), purpose="batch"
            )
        with pytest.raises(openai.APIStatusError, match="limit of 4096 bytes") as oversize:
            await api.files.create(file=("in.jsonl", jsonl([chat_line("big", "x" * 5000)])), purpose="batch")
        assert oversize.value.status_code == 413
        wrong_method = jsonl([{**chat_line("a", "x"), "method": "GET"}])
        with pytest.raises(openai.BadRequestError, match="Line 1"):
            await api.files.create(file=("in.jsonl", wrong_method), purpose="batch")

        uploaded = await api.files.create(file=("in.jsonl", good), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint") as unknown_endpoint:
            await api.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/moderations",  # type: ignore[arg-type]
                completion_window="24h",
            )
        assert unknown_endpoint.value.code == "invalid_endpoint"
        with pytest.raises(openai.BadRequestError, match="lines target '/v1/chat/completions'"):
            await api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.NotFoundError, match="file-nope"):
            await api.batches.create(
                input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
            )

        # Another tenant sees neither the file nor a batch made from it.
        batch = await api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for call in (
            other.files.retrieve(uploaded.id),
            other.files.content(uploaded.id),
            other.files.delete(uploaded.id),
            other.batches.retrieve(batch.id),
            other.batches.cancel(batch.id),
            other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"),
        ):
            with pytest.raises(openai.NotFoundError) as hidden:
                await call
            assert hidden.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        assert (await other.files.list()).data == []
        assert (await other.batches.list()).data == []

        # Nothing else was lost: the good file is intact and listed; deleting it works for its owner.
        assert (await api.files.content(uploaded.id)).content == good
        assert [f.id for f in (await api.files.list()).data] == [uploaded.id]
        assert (await api.files.delete(uploaded.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await api.files.retrieve(uploaded.id)


async def test_cancel_keeps_finished_lines(ingress: str, settings: Settings, redis: Redis, tmp_path: Path) -> None:
    await heartbeat(redis, Names(settings.topic_prefix))
    lines = [chat_line(f"ok-{n}", f"fine {n}") for n in range(3)] + [chat_line(f"slow-{n}", "HANG") for n in range(2)]
    api = client(ingress)
    async with ResultsWorker(settings, redis):
        with batch_worker(settings, tmp_path / "batch-worker.log"):
            uploaded = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = await api.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            for _ in range(300):
                current = await api.batches.retrieve(batch.id)
                if current.request_counts.completed == 3:
                    break
                await _sleep(0.1)
            assert current.request_counts.completed == 3, current
            cancelling = await api.batches.cancel(batch.id)
            assert cancelling.status == "cancelling" and cancelling.cancelling_at
            done = await wait_status(api, batch.id, {"cancelled"})
    assert done.cancelled_at and (done.request_counts.completed, done.request_counts.failed) == (3, 2)
    output = await download(api, done.output_file_id)
    errors = await download(api, done.error_file_id)
    assert [line.custom_id for line in output] == ["ok-0", "ok-1", "ok-2"]
    assert sorted(line.custom_id for line in errors) == ["slow-0", "slow-1"]
    assert all(line.error is not None and line.error.code == "batch_cancelled" for line in errors)
    # The in-flight lines were cancelled through the one cancel path: their markers are set.
    names = Names(settings.topic_prefix)
    assert await redis.exists(names.cancel_key(f"{batch.id}-L4"), names.cancel_key(f"{batch.id}-L5")) == 2
    await api.close()


async def test_a_batch_cancelled_before_it_was_validated_ends_cancelled(
    ingress: str, settings: Settings, redis: Redis, tmp_path: Path
) -> None:
    # No batch worker yet, so the batch is still validating when the cancel comes (a CI run's cancel right after
    # submit once met it so): the worker must end it, not fail every step on the lines it never prepared.
    await heartbeat(redis, Names(settings.topic_prefix))
    api = client(ingress)
    uploaded = await api.files.create(file=("in.jsonl", jsonl([chat_line("never", "run me")])), purpose="batch")
    batch = await api.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating"
    assert (await api.batches.cancel(batch.id)).status == "cancelling"
    with batch_worker(settings, tmp_path / "batch-worker.log"):
        done = await wait_status(api, batch.id, {"cancelled", "failed", "completed"})
    assert done.status == "cancelled" and done.cancelled_at, done
    assert done.request_counts.total == 0 and done.output_file_id is None and done.error_file_id is None
    assert not await redis.exists(Names(settings.topic_prefix).cancel_key(f"{batch.id}-L1"))  # nothing to abort
    await api.close()


async def test_batch_expires_at_the_window_end(
    settings: Settings, redis: Redis, tmp_path: Path, cleanup_topics: None
) -> None:
    # The window must outlast the fake worker's consumer joining its group on a loaded box (the quick line has
    # to finish inside it); 4 s proved too short once the Celery worker took 2 s to start.
    short = settings.model_copy(update={"batch_window_s": 8})
    await heartbeat(redis, Names(settings.topic_prefix))
    lines = [chat_line("quick", "fast one"), chat_line("stuck", "HANG")]
    async with running_ingress(short) as url, ResultsWorker(short, redis), client(url) as api:
        with batch_worker(short, tmp_path / "batch-worker.log"):
            uploaded = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = await api.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert batch.expires_at - batch.created_at == 8
            done = await wait_status(api, batch.id, {"expired", "completed", "failed"})
            output = await download(api, done.output_file_id)
            errors = await download(api, done.error_file_id)
    assert done.status == "expired" and done.expired_at, done
    assert [line.custom_id for line in output] == ["quick"]
    assert [(line.custom_id, line.error.code if line.error else None) for line in errors] == [
        ("stuck", "batch_expired")
    ]


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


async def test_a_result_seen_twice_is_stored_and_counted_once(settings: Settings, redis: Redis) -> None:
    """``llm.results`` is at-least-once and a collector that crashed re-reads from its stored offsets: the same
    outcome arriving again changes nothing, and the offsets move in the same atomic step."""
    from sluicegate.api.limits import Limits
    from sluicegate.batches.store import BatchStore, LineOutcome

    names = Names(settings.topic_prefix)
    store = BatchStore(settings, redis, names)
    batch = await store.create(
        tenant="acme", endpoint="/v1/chat/completions", input_file_id="file-x", metadata=None, limits=Limits()
    )
    outcome = LineOutcome(code="invalid_request", message="no", status_code=400)
    assert (await store.resolve([(batch.id, 1, outcome)], {0: 5})).total == 1
    assert (await store.resolve([(batch.id, 1, outcome), (batch.id, 2, outcome)], {0: 7, 1: 3})).total == 1
    state = await store.state(batch.id)
    assert state is not None and state["failed"] == "2"
    assert await redis.hgetall(names.batch_collector_offsets_key) == {b"0": b"7", b"1": b"3"}
    assert await store.transition(batch.id, "in_progress", ("validating",))
    assert await store.transition(batch.id, "cancelling", ("validating", "in_progress"))
    assert not await store.transition(batch.id, "finalizing", ("in_progress",))  # a cancel is never overwritten
