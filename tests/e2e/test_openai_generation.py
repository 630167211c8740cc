"""Structured output, tools, logprobs, ``n`` and the sampling extras through the whole pipeline with the official
``openai`` client, streamed and not, on the random-weight model (whose output is valid only because the
grammar makes it so). The model's chat template here is Hermes-style, so tools render and auto tool calls are
read as ``<tool_call>`` blocks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from gpu_workers.engine import LLM, SamplingParams

from .conftest import MODEL_NAME, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HERMES_TEMPLATE = (
    "{% if tools %}<s>system: Tools: {% for tool in tools %}{{ tool | tojson }} {% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<s>assistant: "
    "{% for call in message['tool_calls'] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}\n"
    "{% elif message['role'] == 'tool' %}<s>tool: <tool_response>{{ message['content'] }}</tool_response>\n"
    "{% else %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
USER = [{"role": "user", "content": "Tell me about the river"}]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model with a Hermes-style, tool-aware chat template."""
    from transformers import AutoTokenizer

    from gpu_workers.engine.models.random_checkpoint import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME, arch="llama", num_layers=2, hidden_size=64)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), device="cpu")


def _client(pipeline: Pipeline) -> OpenAI:
    return OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=120)


def _chat(pipeline: Pipeline, **kwargs: Any) -> Any:
    body = {"model": pipeline.model, "messages": USER, "max_tokens": 120, "temperature": 1.0, "seed": 7} | kwargs
    return _client(pipeline).chat.completions.create(**body)


def _streamed(pipeline: Pipeline, **kwargs: Any) -> list[Any]:
    return list(_chat(pipeline, stream=True, stream_options={"include_usage": True}, **kwargs))


def _content(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def _finish(chunks: list[Any], index: int = 0) -> str | None:
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == index]
    return next((r for r in reasons if r), None)


def _reassembled_calls(chunks: list[Any]) -> list[dict[str, Any]]:
    """Tool-call deltas put back together the way OpenAI's clients do: by ``index``."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "the id comes once, in the call's first delta"
                    call["id"] = delta.id
                    assert delta.type == "function" and delta.function.name
                    call["name"] = delta.function.name
                else:
                    assert delta.function.name is None, "the name comes only in the first delta"
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


# --- response_format --------------------------------------------------------------------------------------
def test_json_schema_output_parses_and_validates_streamed_and_not(pipeline: Pipeline) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2, 3):
        whole = _chat(pipeline, response_format=fmt, seed=seed)
        assert whole.choices[0].finish_reason == "stop", whole.choices[0].message.content
        jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
        chunks = _streamed(pipeline, response_format=fmt, seed=seed)
        assert _content(chunks) == whole.choices[0].message.content  # same seed, same output
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_json_object_output_is_a_json_object(pipeline: Pipeline) -> None:
    for stream in (False, True):
        if stream:
            chunks = _streamed(pipeline, response_format={"type": "json_object"}, max_tokens=400, temperature=0.3)
            text, reason = _content(chunks), _finish(chunks)
        else:
            out = _chat(pipeline, response_format={"type": "json_object"}, max_tokens=400, temperature=0.3)
            text, reason = out.choices[0].message.content, out.choices[0].finish_reason
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)


def test_native_api_takes_a_regex_and_logprobs(pipeline: Pipeline) -> None:
    accepted = pipeline.submit(
        prompt="The river", max_tokens=30, guided={"regex": "[a-z]{3,8}-[0-9]{2}"}, logprobs=2, n=2, seed=3
    )
    events = pipeline.wait_stream_end(accepted["request_id"])
    texts = {0: "", 1: ""}
    for event in events:
        if event.type == "token":
            texts[event.index] += event.text
            assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
            assert all(len(lp.top) == 2 for lp in event.logprobs)
    assert events[-1].type == "done"
    import re

    assert all(re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", t) for t in texts.values()), texts


# --- tools ------------------------------------------------------------------------------------------------
def test_named_tool_choice_forces_a_valid_call(pipeline: Pipeline) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(pipeline, tools=TOOLS, tool_choice=choice)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = _streamed(pipeline, tools=TOOLS, tool_choice=choice)
    (streamed,) = _reassembled_calls(chunks)
    assert streamed["name"] == "get_weather" and streamed["arguments"] == call.function.arguments
    assert sum(1 for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []) > 3, "arguments in pieces"
    assert _finish(chunks) == "tool_calls"

    # Cut short by max_tokens, the call's arguments do not parse: the choice says "length", as OpenAI's does.
    cut = _chat(pipeline, tools=TOOLS, tool_choice=choice, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    (partial,) = cut.choices[0].message.tool_calls
    assert partial.function.name == "get_weather" and partial.function.arguments.startswith("{")
    assert _finish(_streamed(pipeline, tools=TOOLS, tool_choice=choice, max_tokens=3)) == "length"


def test_required_tool_choice_calls_offered_tools(pipeline: Pipeline) -> None:
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for seed in (4, 5):
        # One call per answer: a random model would otherwise list calls until max_tokens.
        out = _chat(pipeline, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert out.choices[0].finish_reason == "tool_calls"
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        chunks = _streamed(pipeline, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        streamed = _reassembled_calls(chunks)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]
        assert _finish(chunks) == "tool_calls"


def test_auto_tool_calls_are_read_from_the_models_own_format(pipeline: Pipeline) -> None:
    """``tool_choice`` auto. A random-weight model never writes a tool call by itself, so vLLM's ``guided_regex``
    extra makes it write one in its own (Hermes) format, with a free choice inside; the grammar only shapes
    the sampled text, which then takes the path a real model's does: the chat template, the worker, the
    stream, and ingress's reading of ``<tool_call>`` blocks, whole and while they are written."""
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'
    weather = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "unit": "[cf]"\}\}</tool_call>'
    for regex, names in [
        (r"Let me check\." + call, ["get_time"]),
        (call + "\n" + weather, ["get_time", "get_weather"]),
    ]:
        extra = {"tools": TOOLS, "max_tokens": 400, "extra_body": {"guided_regex": regex}}
        out = _chat(pipeline, **extra)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content == ("Let me check." if len(names) == 1 else None)
        whole = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert [n for n, _ in whole] == names and all(c.id.startswith("call_") for c in choice.message.tool_calls)
        for name, arguments in whole:
            jsonschema.validate(arguments, {"get_time": TIME, "get_weather": WEATHER}[name])

        chunks = _streamed(pipeline, **extra)
        assert _content(chunks) == (choice.message.content or "")
        assert not any("<tool" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
        streamed = _reassembled_calls(chunks)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == whole  # same seed, same text
        fragments = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [] if not d.id]
        assert len(fragments) > len(names), "the arguments arrive in pieces while the call is written"
        assert _finish(chunks) == "tool_calls"


def test_guided_regex_combines_with_no_other_constraint(pipeline: Pipeline) -> None:
    with pytest.raises(BadRequestError) as caught:  # a contradiction, like response_format's (400)
        _chat(pipeline, response_format={"type": "json_object"}, extra_body={"guided_regex": "[a-z]+"})
    assert caught.value.body["param"] == "guided_regex", caught.value.body
    plain = _chat(pipeline, max_tokens=40, extra_body={"guided_regex": "[a-z]{3,8}-[0-9]{2}"})
    assert re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", plain.choices[0].message.content)


def test_tools_and_tool_messages_go_through_the_chat_template(pipeline: Pipeline) -> None:
    plain = _chat(pipeline, max_tokens=5)
    offered = _chat(pipeline, max_tokens=5, tools=TOOLS)  # auto: the model answers in prose here
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert offered.choices[0].finish_reason in ("stop", "length") and offered.choices[0].message.content is not None
    none = _chat(pipeline, max_tokens=5, tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    conversation = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    answered = _chat(pipeline, messages=conversation, max_tokens=5, tools=TOOLS)
    assert answered.usage.prompt_tokens > offered.usage.prompt_tokens


# --- logprobs, n ------------------------------------------------------------------------------------------
def test_chat_logprobs_shapes(pipeline: Pipeline) -> None:
    out = _chat(pipeline, logprobs=True, top_logprobs=3, max_tokens=8)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # The token's own bytes: its text unless it holds part of a multi-byte character (then U+FFFD).
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    chunks = _streamed(pipeline, logprobs=True, top_logprobs=3, max_tokens=8)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = _chat(pipeline, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape(pipeline: Pipeline) -> None:
    client = _client(pipeline)
    out = client.completions.create(model=pipeline.model, prompt="The river", max_tokens=6, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    # Sampled, a token outside the top two still has its logprob among the alternatives (up to three of them).
    sampled = (
        client.completions.create(
            model=pipeline.model, prompt="The river", max_tokens=12, logprobs=2, temperature=1.5, seed=5
        )
        .choices[0]
        .logprobs
    )
    # (Byte tokens of a partial character all read "\ufffd", so two alternatives may share a key.)
    assert all(t in sampled.top_logprobs[i] and len(sampled.top_logprobs[i]) <= 3 for i, t in enumerate(sampled.tokens))


def test_n_choices_streamed_and_not(pipeline: Pipeline) -> None:
    out = _chat(pipeline, n=3, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in out.choices), out.choices
    assert len({c.message.content for c in out.choices}) > 1, "sampled choices differ"
    assert out.usage.completion_tokens == 30
    chunks = _streamed(pipeline, n=3, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    assert [_content(chunks, i) for i in range(3)] == [c.message.content for c in out.choices]
    assert all(_finish(chunks, i) == "length" for i in range(3))
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_a_list_of_prompts_is_one_request_each_streamed_and_not(pipeline: Pipeline) -> None:
    """OpenAI's list ``prompt`` on /v1/completions: prompt i's choice j is choice i * n + j, the usage is the sum,
    and streamed the parts' chunks interleave before one usage chunk and one [DONE]."""
    client = _client(pipeline)
    prompts = ["The river", "Once upon a time", "A cat sat"]
    ask = {"model": pipeline.model, "max_tokens": 5, "temperature": 1.0, "seed": 3, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **ask).usage.prompt_tokens for p in prompts]
    out = client.completions.create(prompt=prompts, n=2, **ask)
    assert [c.index for c in out.choices] == list(range(6))
    assert all(c.text and c.finish_reason == "length" for c in out.choices), out.choices
    assert out.usage.completion_tokens == 30 and out.usage.prompt_tokens == sum(alone)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 30

    chunks = list(
        client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **ask)
    )
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert sorted(texts) == list(range(6)) and all(texts.values()) and ends == dict.fromkeys(range(6), "length")
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == sum(alone)

    # vLLM's continuous_usage_stats: each part's chunks count that part's own prompt from its first chunk on.
    options = {"include_usage": True, "continuous_usage_stats": True}
    running = list(client.completions.create(prompt=prompts, n=2, stream=True, stream_options=options, **ask))
    parts = [chunk for chunk in running[:-1] if chunk.choices]
    assert parts and all(chunk.usage is not None for chunk in parts)
    for chunk in parts:
        assert chunk.usage.prompt_tokens == alone[chunk.choices[0].index // 2], chunk
    assert running[-1].usage.prompt_tokens == sum(alone)

    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **ask)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_sampling_extras_reach_the_engine(pipeline: Pipeline, llm: LLM) -> None:
    """Penalties, min_p and logit_bias: the pipeline's greedy output equals the engine's own with the same
    params, and differs from plain greedy (so they were not dropped on the way)."""
    extras = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "logit_bias": {"100": 5.0}}
    vllm_extras = {"repetition_penalty": 1.3, "min_p": 0.05}
    client = _client(pipeline)
    common = {"model": pipeline.model, "prompt": "The river ran", "max_tokens": 16, "temperature": 0}
    out = client.completions.create(**common, **extras, extra_body={"ignore_eos": True, **vllm_extras})
    plain = client.completions.create(**common, extra_body={"ignore_eos": True})
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={100: 5.0}, presence_penalty=1.5,
        frequency_penalty=1.0, repetition_penalty=1.3, min_p=0.05,
    )  # fmt: skip
    assert out.choices[0].text == llm.generate(["The river ran"], params)[0].text
    assert out.choices[0].text != plain.choices[0].text
    bias = client.chat.completions.create(
        model=pipeline.model, messages=USER, max_completion_tokens=4, logit_bias={"100": 100}, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert bias.usage.completion_tokens == 4 and bias.choices[0].finish_reason == "length"


# --- refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"max_completion_tokens": 100_000}, "max_completion_tokens"),
    ],
)
def test_refusals_are_400_naming_the_parameter(pipeline: Pipeline, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        _chat(pipeline, **extra)
    assert caught.value.status_code == 400 and caught.value.body["param"] == param, caught.value.body


def test_contradictions_and_bad_schemas_name_the_parameter(pipeline: Pipeline) -> None:
    url, headers = f"{pipeline.ingress_url}/v1/chat/completions", pipeline.headers()
    base = {"model": pipeline.model, "messages": USER}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, None),
    ]
    for extra, param in cases:
        response = httpx.post(url, json=base | extra, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (param or "response_format") in (error["param"] or "") + error["message"], error


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(pipeline: Pipeline) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``, which guidellm sends on every streamed request: each chunk
    carries the tokens so far, ending at the figures of the closing usage chunk."""
    chunks = list(
        _chat(
            pipeline,
            stream=True,
            max_tokens=12,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    completions = [c.usage.completion_tokens for c in with_choices]
    assert completions == sorted(completions) and completions[0] == 0
    assert completions[-1] == final.usage.completion_tokens > 0
    for c in with_choices:
        assert c.usage.prompt_tokens == final.usage.prompt_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
