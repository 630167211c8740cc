"""A reasoning model through the real ingress, Kafka and Redis, read with the official ``openai`` SDK: the
``<think>`` span comes back as ``reasoning_content`` (whole and streamed, tags split across tokens), the client's
``chat_template_kwargs`` reach the worker (Qwen3's ``enable_thinking``), a span the chat template opened is read as
reasoning from the first token, and ``/v1/models`` names the architecture. A fake worker whose output the test
controls stands in for the engine; the chat template is Qwen3-style, published as a worker publishes it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from ingress_support import KEY, MODEL, FakeWorker, heartbeat, running_ingress
from redis.asyncio import Redis

from gpu_workers.engine.models.random_checkpoint import THINKING_CHAT_TEMPLATE, build_tokenizer
from gpu_workers.worker.heartbeat import model_tokenizer
from schemas import InferenceRequest, Names
from sluicegate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

THINKING = ["<th", "ink>\n", "Two plus", " two is", " four.</", "think>\n\n", "The answer", " is 4."]


@pytest.fixture
def settings(test_settings: Settings) -> Settings:
    return test_settings.model_copy(
        update={
            "api_keys": KEY,
            "stream_token_secret": "integration-secret",
            "heartbeat_interval_s": 30.0,
            "kafka_timeout_s": 5.0,
            "request_timeout_s": 30.0,
        }
    )


@pytest.fixture
async def ingress(settings: Settings, cleanup_topics: None) -> AsyncIterator[str]:
    async with running_ingress(settings) as url:
        yield url


def _reply(request: InferenceRequest) -> list[str]:
    """What a Qwen3 model writes: thinking first, unless the template closed the span (or opened it)."""
    kwargs = request.chat_template_kwargs or {}
    if kwargs.get("enable_thinking") is False:
        return ["The answer", " is 4."]
    if kwargs.get("open_think"):
        return ["Easy.", "</th", "ink>", "Four."]
    return THINKING


async def _publish_thinking_template(redis: Redis, settings: Settings) -> None:
    tokenizer = build_tokenizer(512)
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE
    published = model_tokenizer(MODEL, tokenizer, max_model_len=None)
    assert published is not None
    await redis.set(Names(settings.topic_prefix).tokenizer_key(MODEL), published)


def _reasoning(message: Any) -> Any:
    # The SDK keeps fields it does not know as attributes (and in model_extra).
    return getattr(message, "reasoning_content", None)


async def test_reasoning_content_through_the_openai_sdk(ingress: str, settings: Settings, redis: Redis) -> None:
    names = Names(settings.topic_prefix)
    await heartbeat(redis, names, reasoning_parser="qwen3", architecture="Qwen3ForCausalLM")
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "What is two plus two?"}]
    async with FakeWorker(settings, redis, reply=_reply) as worker:
        await _publish_thinking_template(redis, settings)  # after the fake worker's own, as a Qwen3 worker's

        chat = await client.chat.completions.create(model=MODEL, messages=messages)
        message = chat.choices[0].message
        assert _reasoning(message) == "Two plus two is four."
        assert message.model_extra is not None and message.model_extra["reasoning_content"] == _reasoning(message)
        assert message.content == "The answer is 4."

        stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
        deltas = [c.choices[0].delta async for c in stream if c.choices]
        streamed_reasoning = [_reasoning(d) for d in deltas if _reasoning(d)]
        assert "".join(streamed_reasoning) == "Two plus two is four."
        assert "".join(d.content or "" for d in deltas) == "The answer is 4."
        assert not any("think>" in (d.content or "") + (_reasoning(d) or "") for d in deltas)

        # The client switches thinking off: the worker gets the template variable, the answer is all content.
        off = await client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert _reasoning(off.choices[0].message) is None and off.choices[0].message.content == "The answer is 4."
        assert worker.seen[-1][1].chat_template_kwargs == {"enable_thinking": False}

        # A template that opened the span in the prompt: the output starts inside the reasoning.
        opened = await client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, extra_body={"chat_template_kwargs": {"open_think": True}}
        )
        deltas = [c.choices[0].delta async for c in opened if c.choices]
        assert "".join(_reasoning(d) or "" for d in deltas) == "Easy."
        assert "".join(d.content or "" for d in deltas) == "Four."

        # Variables the pipeline sets itself are refused before anything is queued.
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            await client.chat.completions.create(
                model=MODEL, messages=messages, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
            )

    cards = {m.id: m for m in (await client.models.list()).data}
    assert json.loads(cards[MODEL].model_dump_json())["architecture"] == "Qwen3ForCausalLM"


async def test_a_model_without_a_reasoning_parser_keeps_the_tags_in_the_answer(
    ingress: str, settings: Settings, redis: Redis
) -> None:
    await heartbeat(redis, Names(settings.topic_prefix))
    client = openai.AsyncOpenAI(base_url=f"{ingress}/v1", api_key=KEY, max_retries=0)
    async with FakeWorker(settings, redis, reply=_reply):
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}])
    message = chat.choices[0].message
    assert message.content == "".join(THINKING) and _reasoning(message) is None
