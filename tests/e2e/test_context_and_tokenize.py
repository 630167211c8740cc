"""Exact prompt counts in ingress: the worker publishes its tokenizer to Redis, ingress counts with it,
answers ``/tokenize`` and ``/detokenize`` as vLLM does, and refuses prompt + ``max_tokens`` over the context with
a 400 ``context_length_exceeded`` before anything reaches Kafka (checked with the official openai SDK)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, OpenAI
from transformers import AutoTokenizer

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONTEXT = 128


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"SLUICEGATE_MAX_MODEL_LEN": str(CONTEXT)}


def _post(pipeline: Pipeline, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {pipeline.api_key}"}
    return httpx.post(f"{pipeline.ingress_url}{path}", json=body, headers=headers, timeout=30)


def _tokenize(pipeline: Pipeline, body: dict) -> dict:
    deadline = time.monotonic() + 60
    while True:  # the worker publishes its tokenizer with its first heartbeat
        response = _post(pipeline, "/tokenize", {"model": pipeline.model, **body})
        if response.status_code != 503 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.5)


def test_tokenize_and_detokenize_match_the_models_tokenizer(pipeline: Pipeline, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = _tokenize(pipeline, {"prompt": "The river ran quietly"})
    expected = tokenizer.encode("The river ran quietly")
    assert text == {"count": len(expected), "max_model_len": CONTEXT, "tokens": expected}
    messages = [{"role": "user", "content": "hi there"}]
    chat = _tokenize(pipeline, {"messages": messages})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = rendered if isinstance(rendered, list) else list(rendered["input_ids"])
    assert chat["tokens"] == rendered and chat["count"] == len(rendered)
    back = _post(pipeline, "/detokenize", {"model": pipeline.model, "tokens": expected})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(expected)}
    assert _post(pipeline, "/detokenize", {"model": pipeline.model, "tokens": [10**6]}).status_code == 400
    assert _post(pipeline, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404


def test_tokenize_counts_any_conversation_chat_completions_serves(pipeline: Pipeline) -> None:
    """An assistant turn that only calls a tool (no content) and text parts, as OpenAI clients send them: counted
    as the chat request's own prompt_tokens."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather in"}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    counted = _tokenize(pipeline, {"messages": messages})
    chat = _post(pipeline, "/v1/chat/completions", {"model": pipeline.model, "messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert counted["count"] == chat.json()["usage"]["prompt_tokens"]


def test_one_prompt_of_a_list_over_the_context_refuses_the_whole_call(pipeline: Pipeline) -> None:
    """Each prompt of a list is checked as its own request: one too long is the call's 400, naming the context,
    and the prompts already queued are withdrawn; the next call is served."""
    client = OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=60)
    long = "The river ran quietly past the old mill " * 20
    assert _tokenize(pipeline, {"prompt": long})["count"] > CONTEXT
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model=pipeline.model, prompt=["short one", long], max_tokens=4)
    assert caught.value.code == "context_length_exceeded", caught.value.body
    out = client.completions.create(model=pipeline.model, prompt=["short one", "two"], max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1]


def test_prompt_plus_max_tokens_over_the_context_is_a_400_at_once(pipeline: Pipeline) -> None:
    client = OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "The river ran quietly past the old mill " * 6}]
    prompt_tokens = _tokenize(pipeline, {"messages": messages})["count"]
    assert prompt_tokens < CONTEXT  # the prompt alone fits
    max_tokens = CONTEXT - prompt_tokens + 1
    started = time.monotonic()
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=pipeline.model, messages=messages, max_tokens=max_tokens)
    assert time.monotonic() - started < 5
    error = caught.value.body
    assert caught.value.code == "context_length_exceeded", error
    assert f"maximum context length is {CONTEXT} tokens" in caught.value.message
    assert f"{prompt_tokens} in the messages, {max_tokens} in the completion" in caught.value.message
    # One token fewer fits and runs; without max_tokens the default shrinks to the room left.
    out = client.chat.completions.create(
        model=pipeline.model, messages=messages, max_tokens=max_tokens - 1, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == max_tokens - 1
    out = client.chat.completions.create(model=pipeline.model, messages=messages, extra_body={"ignore_eos": True})
    assert out.usage.total_tokens == CONTEXT


def test_a_token_id_outside_the_vocabulary_is_a_400_naming_its_field(pipeline: Pipeline) -> None:
    """Token-id prompts are checked against the published tokenizer in ingress: a 400 that names ``prompt`` (or
    ``input``) before anything is queued, as vLLM answers, not an error from the worker without a field."""
    client = OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=60)
    _tokenize(pipeline, {"prompt": "wait for the tokenizer"})
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model=pipeline.model, prompt=[5, 10**6], max_tokens=2)
    assert caught.value.body["param"] == "prompt" and "10000" in caught.value.message
    with pytest.raises(BadRequestError) as caught:
        client.embeddings.create(model=pipeline.model, input=[[3, 4], [10**6]])
    assert caught.value.body["param"] == "input"
    assert client.completions.create(model=pipeline.model, prompt=[5, 6], max_tokens=2).choices[0].text is not None
