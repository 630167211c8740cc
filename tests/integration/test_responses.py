"""The Responses API through the official ``openai`` SDK, against real ingress processes (uvicorn) on real Kafka
and Redis, with a fake worker answering through them: plain, streamed, background (polled, and streamed then
resumed after a dropped connection, through another ingress), conversations by ``previous_response_id``, a tool
call round trip, cancel, delete, tenants, refused fields, and the sweeper that saves a result nobody reads."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from ingress_support import KEY, MODEL, FakeWorker, eventually, heartbeat, reply_for, running_ingress
from redis.asyncio import Redis

from ingress.auth import hash_key
from schemas import CancelRequest, InferenceRequest, Names
from sluicegate.settings import Settings
from sluicegate.task_stop import cancel_and_wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

OTHER_KEY = "sk-another-tenant-key"

TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 5,  # "You said: hello there kafka" is five pieces
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(
        update={
            "api_keys": f"{KEY},{OTHER_KEY}",
            "stream_token_secret": "integration-secret",
            "topic_partitions": 2,
            "request_timeout_s": 30.0,
            "responses_sweep_s": 0.3,
        }
    )


@pytest.fixture
async def ingress(settings: Settings, redis: Redis, cleanup_topics: None) -> AsyncIterator[str]:
    names = Names(settings.topic_prefix)

    async def beating() -> None:  # a live worker's heartbeat, kept fresh however slow a loaded machine runs
        while True:
            await heartbeat(redis, names)
            await asyncio.sleep(1.0)

    beats = asyncio.create_task(beating())
    await heartbeat(redis, names)
    try:
        async with running_ingress(settings) as url:
            yield url
    finally:
        await cancel_and_wait(beats)


def client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def weather_reply(request: InferenceRequest) -> list[str]:
    """Arguments while get_weather is forced; after its output came back, an answer that quotes the output."""
    assert request.messages is not None
    last = request.messages[-1]
    if last.role == "tool":
        return ["In", " Oslo:", f" {last.text()}"]
    if request.guided is not None:
        return ['{"city"', ': "Oslo"}']
    return reply_for(request)


async def test_plain_response_is_stored_and_listed(ingress: str, settings: Settings, redis: Redis) -> None:
    api = client(ingress)
    async with FakeWorker(settings, redis) as worker:
        response = await api.responses.create(
            model=MODEL, input="hello there kafka", instructions="Be terse.", metadata={"k": "v"}, temperature=0
        )
        assert response.status == "completed" and response.object == "response"
        assert response.id.startswith("resp_") and response.model == MODEL
        assert response.output_text == "You said: hello there kafka"
        assert response.usage is not None
        assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (7, 5, 12)
        assert response.usage.input_tokens_details.cached_tokens == 2
        assert (response.instructions, response.metadata, response.temperature) == ("Be terse.", {"k": "v"}, 0.0)
        # OpenAI's defaults and a completed response's time, as the SDK reads them.
        assert response.tool_choice == "auto" and response.max_tool_calls is None
        assert response.completed_at is not None and response.completed_at >= response.created_at
        (_, request) = worker.seen[0]
        assert request.messages is not None
        assert [(m.role, m.text()) for m in request.messages] == [
            ("system", "Be terse."),
            ("user", "hello there kafka"),
        ]

        again = await api.responses.retrieve(response.id)
        assert again.model_dump() == response.model_dump()
        items = await api.responses.input_items.list(response.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [  # type: ignore[union-attr]
            ("message", "user", "hello there kafka")
        ]

        several = await api.responses.create(
            model=MODEL,
            input=[
                {"role": "system", "content": "Sys."},
                {"role": "user", "content": "one"},
                {"role": "user", "content": "two"},
            ],
        )
        page = await api.responses.input_items.list(several.id, order="asc", limit=2)
        assert [i.content[0].text for i in page.data] == ["Sys.", "one"] and page.has_more  # type: ignore[union-attr]
        rest = await api.responses.input_items.list(several.id, order="asc", after=page.data[-1].id)
        assert [i.content[0].text for i in rest.data] == ["two"] and not rest.has_more  # type: ignore[union-attr]
        newest = await api.responses.input_items.list(several.id, limit=1)  # OpenAI's default order: newest first
        assert newest.data[0].content[0].text == "two"  # type: ignore[union-attr]

        # Fields that change nothing here are accepted and echoed: max_tool_calls counts built-in tool calls only.
        echoed = await api.responses.create(
            model=MODEL, input="echo", max_tool_calls=2, extra_body={"prompt_cache_retention": "24h"}
        )
        assert echoed.max_tool_calls == 2 and echoed.model_dump()["prompt_cache_retention"] == "24h"

        # store: false answers the same and keeps nothing.
        unstored = await api.responses.create(model=MODEL, input="not kept", store=False)
        assert unstored.output_text == "You said: not kept" and unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(unstored.id)

        await api.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(response.id)
    await api.close()


async def test_streamed_events_in_order_with_sequence_numbers(ingress: str, settings: Settings, redis: Redis) -> None:
    api = client(ingress)
    async with FakeWorker(settings, redis):
        stream = await api.responses.create(model=MODEL, input="hello there kafka", stream=True)
        events = [event async for event in stream]
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            *TEXT_EVENTS,
            "response.completed",
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
        assert deltas == "You said: hello there kafka"

        async with api.responses.stream(model=MODEL, input="streamed by the helper") as helper:
            texts = [e.delta async for e in helper if e.type == "response.output_text.delta"]
            final = await helper.get_final_response()
        assert "".join(texts) == final.output_text == "You said: streamed by the helper"
        assert final.status == "completed" and final.usage is not None
        # Stored: the same object afterwards.
        assert (await api.responses.retrieve(final.id)).output_text == final.output_text
    await api.close()


async def test_background_is_queued_then_polled_through_another_ingress(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    async with running_ingress(settings) as first:
        api = client(first)
        queued = await api.responses.create(model=MODEL, input="later please", background=True)
        assert queued.status == "queued" and queued.background is True and queued.output == []
        await api.close()
    # The ingress that took it is gone; the worker starts only now: state is in Redis, the request in Kafka.
    api = client(ingress)
    async with FakeWorker(settings, redis):
        deadline = time.monotonic() + 30
        while (polled := await api.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    assert polled.status == "completed" and polled.output_text == "You said: later please"
    assert polled.usage is not None and polled.usage.output_tokens == 4

    async with httpx.AsyncClient(base_url=ingress, headers={"Authorization": f"Bearer {KEY}"}) as http:
        refused = await http.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "background": True, "store": False}
        )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
    await api.close()


async def test_background_stream_resumes_after_a_dropped_connection(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    names = Names(settings.topic_prefix)
    long_input = " ".join(f"w{n}" for n in range(30))
    async with FakeWorker(settings, redis, token_delay_s=0.05):
        api = client(ingress)
        stream = await api.responses.create(model=MODEL, input=long_input, background=True, stream=True)
        first: list[Any] = []
        async for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta" and len(first) > 8:
                break
        await stream.close()  # the connection drops mid-stream
        response_id = first[0].response.id
        assert [e.sequence_number for e in first] == list(range(len(first)))
        assert [e.type for e in first[:4]] == [
            "response.created",
            "response.queued",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert first[0].response.status == "queued"
        last = first[-1].sequence_number

        # Resumed through another ingress process, from the last event the client had.
        async with running_ingress(settings) as second:
            other = client(second)
            rest = [e async for e in await other.responses.retrieve(response_id, stream=True, starting_after=last)]
            async with other.responses.stream(response_id=response_id, starting_after=last) as helper:
                again = [e async for e in helper]
                final = await helper.get_final_response()
            await other.close()
        await api.close()
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))  # every event once, in order
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == f"You said: {long_input}" == final.output_text
    assert [(e.sequence_number, e.type) for e in again] == [(e.sequence_number, e.type) for e in rest]
    # A background stream's client that leaves does not cancel it.
    rid = response_id.removeprefix("resp_")
    assert not await redis.exists(names.cancel_key(rid))


async def test_previous_response_id_continues_the_conversation(ingress: str, settings: Settings, redis: Redis) -> None:
    api, other = client(ingress), client(ingress, OTHER_KEY)
    async with FakeWorker(settings, redis) as worker:
        first = await api.responses.create(model=MODEL, input="my name is Ada", instructions="Remember names.")
        second = await api.responses.create(
            model=MODEL, input="what is my name", previous_response_id=first.id, instructions="Answer briefly."
        )
        assert second.previous_response_id == first.id
        third = await api.responses.create(model=MODEL, input="and again", previous_response_id=second.id)
        with pytest.raises(openai.NotFoundError):  # another tenant cannot continue it
            await other.responses.create(model=MODEL, input="steal", previous_response_id=first.id)
    (_, request) = next(s for s in worker.seen if s[1].request_id == second.id.removeprefix("resp_"))
    assert request.messages is not None
    assert [(m.role, m.text()) for m in request.messages] == [
        ("system", "Answer briefly."),  # instructions are not carried over
        ("user", "my name is Ada"),
        ("assistant", "You said: my name is Ada"),
        ("user", "what is my name"),
    ]
    (_, request) = next(s for s in worker.seen if s[1].request_id == third.id.removeprefix("resp_"))
    assert request.messages is not None and len(request.messages) == 5
    assert request.messages[3].text() == "You said: what is my name"
    await api.close()
    await other.close()


async def test_tool_call_round_trip(ingress: str, settings: Settings, redis: Redis) -> None:
    api = client(ingress)
    async with FakeWorker(settings, redis, reply=weather_reply) as worker:
        called = await api.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
        )
        (call,) = called.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
        answered = await api.responses.create(
            model=MODEL,
            input=[output],  # type: ignore[list-item]
            previous_response_id=called.id,
            tools=[WEATHER],  # type: ignore[list-item]
        )
        assert answered.output_text == "In Oslo: sunny, 21 C"
        # Without stored state too: the call sent back as input.
        stateless = await api.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "Weather in Oslo?"}, call, output],  # type: ignore[list-item]
            tools=[WEATHER],  # type: ignore[list-item]
            store=False,
        )
        assert stateless.output_text == "In Oslo: sunny, 21 C"

        # Streamed: the call's events, and the helper's final response.
        async with api.responses.stream(
            model=MODEL, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}
        ) as helper:
            kinds = [e.type async for e in helper]
            final = await helper.get_final_response()
        assert kinds[2:] == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == {"city": "Oslo"}
    (_, request) = next(s for s in worker.seen if s[1].request_id == answered.id.removeprefix("resp_"))
    assert request.messages is not None
    roles = [(m.role, m.tool_calls[0].id if m.tool_calls else m.tool_call_id) for m in request.messages]
    assert roles == [("user", None), ("assistant", call.call_id), ("tool", call.call_id)]
    await api.close()


async def test_cancel_a_background_response(ingress: str, settings: Settings, redis: Redis) -> None:
    names = Names(settings.topic_prefix)
    api = client(ingress)
    async with FakeWorker(settings, redis, mode="hang"):
        started = await api.responses.create(model=MODEL, input="a long story", background=True)
        rid = started.id.removeprefix("resp_")
        await eventually(lambda: redis.exists(names.stream_key(rid)))
        cancelled = await api.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        # Settled, or marked so: no item is left "in_progress" under a cancelled response.
        assert [item.status for item in cancelled.output] == ["incomplete"], cancelled.output
        assert cancelled.usage is not None and cancelled.output_text == "You"  # the worker ended it within the wait
        marker = CancelRequest.model_validate_json(await redis.get(names.cancel_key(rid)))
        assert marker.reason == "client_cancelled"
        await eventually(lambda: _final(redis, names, started.id))
        final = await api.responses.retrieve(started.id)
        assert final.status == "cancelled" and final.output_text == "You"
        assert (await api.responses.cancel(started.id)).status == "cancelled"  # again: unchanged

        foreground = await api.responses.create(model=MODEL, input="x", stream=True)
        first = await anext(aiter(foreground))
        with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
            await api.responses.cancel(first.response.id)
        await foreground.close()
    await api.close()


async def test_cancelling_a_response_no_worker_started_answers_at_once(ingress: str, settings: Settings) -> None:
    api = client(ingress)
    # The first cancel of a run creates the control topic and starts its producer (seconds on a loaded broker):
    # an untimed one first, so the timed one measures the wait alone.
    warm = await api.responses.create(model=MODEL, input="nobody serves this either", background=True)
    assert (await api.responses.cancel(warm.id)).status == "cancelled"
    queued = await api.responses.create(model=MODEL, input="nobody serves this yet", background=True)
    started = time.monotonic()
    cancelled = await api.responses.cancel(queued.id)
    # Nothing to wait for: a worker ends it only when it meets it in its queue.
    assert cancelled.status == "cancelled" and time.monotonic() - started < 1.5
    await api.close()


async def _final(redis: Redis, names: Names, response_id: str) -> bool:
    tenant = f"key-{hash_key(KEY)[:8]}"
    return bool(await redis.hexists(names.response_key(tenant, response_id), "final"))


async def test_another_tenants_response_is_not_found(ingress: str, settings: Settings, redis: Redis) -> None:
    api, other = client(ingress), client(ingress, OTHER_KEY)
    async with FakeWorker(settings, redis):
        mine = await api.responses.create(model=MODEL, input="private", background=True)
        for call in (
            other.responses.retrieve(mine.id),
            other.responses.cancel(mine.id),
            other.responses.delete(mine.id),
            other.responses.input_items.list(mine.id),
        ):
            with pytest.raises(openai.NotFoundError) as caught:
                await call
            assert caught.value.body["message"] == f"Response with id '{mine.id}' not found."  # type: ignore[index]
        assert (await api.responses.retrieve(mine.id)).id == mine.id
    await api.close()
    await other.close()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"background_options": {}}, "background_options"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ],
)
async def test_unsupported_fields_are_refused_by_name(ingress: str, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi"} | extra
    async with httpx.AsyncClient(base_url=ingress, headers={"Authorization": f"Bearer {KEY}"}) as http:
        answer = await http.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter", error
    assert error["type"] == "invalid_request_error"


async def test_the_sweeper_saves_a_result_nobody_read(ingress: str, settings: Settings, redis: Redis) -> None:
    names = Names(settings.topic_prefix)
    api = client(ingress)
    async with FakeWorker(settings, redis):
        queued = await api.responses.create(model=MODEL, input="nobody polls", background=True)
        await eventually(lambda: _final(redis, names, queued.id), timeout_s=20)
    assert await redis.zcard(names.responses_pending_key) == 0
    # The stream can go now: the result stays.
    await redis.delete(names.stream_key(queued.id.removeprefix("resp_")))
    assert (await api.responses.retrieve(queued.id)).output_text == "You said: nobody polls"
    async with httpx.AsyncClient(base_url=ingress, headers={"Authorization": f"Bearer {KEY}"}) as http:
        expired = await http.get(f"/v1/responses/{queued.id}", params={"stream": "true"})
    assert expired.status_code == 400 and expired.json()["error"]["code"] == "stream_expired"
    await api.close()
