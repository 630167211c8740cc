"""Request bodies: what is accepted, what is rejected (and how), and the pipeline request they become."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from schemas import TraceContext, utcnow
from sluicegate.api.bodies import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    MAX_COMPLETION_PROMPTS,
    SEVERAL_PROMPTS,
    ChatCompletionBody,
    CompletionBody,
    NativeRequestBody,
)
from sluicegate.api.build import build_request
from sluicegate.api.errors import ApiError, invalid

USER = [{"role": "user", "content": "hi"}]


def rejected(model: type[BaseModel], body: dict[str, Any], root: str = "prompt") -> ApiError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return invalid(info.value, root_field=root)


def test_chat_body_becomes_a_messages_request() -> None:
    body = ChatCompletionBody.model_validate(
        {
            "model": "llama",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "temperature": 0,
            "stop": "\n",
            "max_completion_tokens": 9,
            "max_tokens": 99,
            "top_k": -1,
            "seed": 7,
            "user": "someone",
            "metadata": {"k": "v"},
        }
    )
    trace = TraceContext(traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    request = build_request(body, request_id="rid", tenant="acme", tier="interactive", trace=trace)
    assert request.prompt is None and request.messages is not None
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.messages[1].text() == "a\nb"  # text parts one per line, as vLLM joins them
    assert request.sampling.temperature == 0.0 and request.sampling.max_tokens == 9
    assert request.sampling.stop == ["\n"] and request.sampling.top_k is None and request.sampling.seed == 7
    assert (request.tenant, request.priority, request.trace) == ("acme", "interactive", trace)
    assert request.user == "someone"  # carried on, so routes sticky per user work past ingress too


@pytest.mark.parametrize("user", ["", "x" * 257, "tab\there"])
def test_a_bad_user_is_refused_naming_it(user: str) -> None:
    error = rejected(CompletionBody, {"model": "m", "prompt": "x", "user": user})
    assert (error.status, error.param) == (400, "user")  # as every invalid field


def test_defaults_for_max_tokens() -> None:
    chat = ChatCompletionBody.model_validate({"model": "m", "messages": USER})
    assert build_request(chat, request_id="r", tenant="t", tier="standard", trace=None).sampling.max_tokens == (
        DEFAULT_MAX_TOKENS
    )
    completion = CompletionBody.model_validate({"model": "m", "prompt": "x"})
    assert completion.resolved_max_tokens() == DEFAULT_COMPLETION_MAX_TOKENS


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("text", "text"), (["text"], "text"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    body = CompletionBody.model_validate({"model": "m", "prompt": prompt})
    assert build_request(body, request_id="r", tenant="t", tier="batch", trace=None).prompt == expected


def test_native_body_with_relative_deadline_and_extras() -> None:
    body = NativeRequestBody.model_validate(
        {"model": "m", "prompt": [5, 6], "deadline": 30, "ignore_eos": True, "priority": "batch", "top_k": 4}
    )
    now = utcnow()
    request = build_request(body, request_id="r", tenant="t", tier="batch", trace=None, now=now)
    assert request.deadline == now + timedelta(seconds=30)
    assert request.sampling.ignore_eos and request.sampling.top_k == 4


def test_native_deadline_in_the_past_is_refused() -> None:
    past = (utcnow() - timedelta(seconds=5)).isoformat()
    body = NativeRequestBody.model_validate({"model": "m", "prompt": "p", "deadline": past})
    with pytest.raises(ValueError, match="already passed"):
        build_request(body, request_id="r", tenant="t", tier="batch", trace=None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"frobnicate": 1}, "frobnicate"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "messages.0.content.0",
        ),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_unsupported_chat_fields_are_400_naming_them(body: dict[str, Any], param: str) -> None:
    error = rejected(ChatCompletionBody, {"model": "m", "messages": USER} | body, "messages")
    assert error.status == 400
    assert error.body()["error"]["param"] == param
    assert error.body()["error"]["code"] == "unsupported_parameter"
    assert param in error.message


def test_harmless_defaults_of_unsupported_fields_are_accepted() -> None:
    ChatCompletionBody.model_validate(
        {
            "model": "m",
            "messages": USER,
            "n": 1,
            "logprobs": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "parallel_tool_calls": True,
            "store": False,
            "service_tier": "auto",
        }
    )


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ChatCompletionBody, {"model": "m", "messages": []}, "messages"),
        (ChatCompletionBody, {"model": "m", "messages": USER, "temperature": 2.5}, "temperature"),
        (ChatCompletionBody, {"model": "m", "messages": USER, "top_p": 0}, "top_p"),
        (
            ChatCompletionBody,
            {"model": "m", "messages": USER, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (ChatCompletionBody, {"messages": USER}, "model"),
        (
            ChatCompletionBody,
            {"model": "m", "messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
        (ChatCompletionBody, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (CompletionBody, {"model": "m", "prompt": ""}, "prompt"),
        (CompletionBody, {"model": "m", "prompt": [1, -2]}, "prompt.1"),
        (CompletionBody, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (NativeRequestBody, {"model": "m"}, "prompt"),
        (NativeRequestBody, {"model": "m", "prompt": "x", "priority": "urgent"}, "priority"),
        (NativeRequestBody, {"model": "m", "prompt": "x", "deadline": "2030-01-01T00:00:00"}, "deadline"),
    ],
)
def test_invalid_values_are_400_naming_the_field(model: type[BaseModel], body: dict[str, Any], param: str) -> None:
    error = rejected(model, body, "messages" if model is ChatCompletionBody else "prompt")
    assert error.status == 400
    payload = error.body()["error"]
    assert payload["param"] == param and payload["type"] == "invalid_request_error"
    assert f"'{param}'" in payload["message"]


def test_several_prompts_in_one_completion_only_where_the_endpoint_takes_them() -> None:
    """A batch line is one request: several prompts are refused there. The online endpoint validates with
    ``SEVERAL_PROMPTS`` and sends each prompt as its own request."""
    error = rejected(CompletionBody, {"model": "m", "prompt": ["a", "b"]})
    assert error.status == 400 and "one request per prompt" in error.message

    def several(prompt: Any) -> CompletionBody:
        return CompletionBody.model_validate({"model": "m", "prompt": prompt, "n": 2}, context=SEVERAL_PROMPTS)

    body = several(["a", "b", "c"])
    assert body.prompts() == ["a", "b", "c"]
    assert [(b.prompt, b.n) for b in body.one_per_prompt()] == [("a", 2), ("b", 2), ("c", 2)]
    assert several([[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert several([1, 2]).prompts() == [[1, 2]] and several(["a"]).prompts() == ["a"] and several("a").prompt == "a"
    for prompt, words in ((["a", ""], "must not be empty"), (["a"] * (MAX_COMPLETION_PROMPTS + 1), "at most")):
        with pytest.raises(ValidationError) as caught:
            several(prompt)
        assert words in str(caught.value)


def test_a_regex_that_does_not_parse_is_refused_naming_it() -> None:
    """Refused at once (it reached the worker, whose grammar compiler failed it after the stream had begun)."""
    for body, root, param in (
        ({"model": "m", "messages": USER, "guided_regex": "(["}, "messages", "guided_regex"),
        ({"model": "m", "prompt": "p", "guided": {"regex": "a)"}}, "prompt", "guided.regex"),
    ):
        error = rejected(ChatCompletionBody if "messages" in body else NativeRequestBody, body, root).body()["error"]
        assert error["param"] == param and "not a valid regular expression" in error["message"], error
    # ECMAScript's named group is the grammar engine's syntax too: not refused for Python's spelling of it.
    named = {"model": "m", "messages": USER, "guided_regex": "(?<year>[0-9]{4})"}
    assert ChatCompletionBody.model_validate(named).guided_spec().regex == "(?<year>[0-9]{4})"  # type: ignore[union-attr]


def test_a_bad_json_schema_is_named_by_its_path_without_the_unions_tag() -> None:
    body = {
        "model": "m",
        "messages": USER,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    }
    error = rejected(ChatCompletionBody, body, "messages").body()["error"]
    assert error["param"] == "response_format.json_schema.schema", error
    assert "not a valid JSON Schema" in error["message"]


def test_chat_takes_openais_inert_cache_and_safety_fields_and_refuses_a_verbosity_it_cannot_honour() -> None:
    inert = {
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "safety_identifier": "u-1",
        "verbosity": "medium",
    }
    ChatCompletionBody.model_validate({"model": "m", "messages": USER} | inert)
    error = rejected(ChatCompletionBody, {"model": "m", "messages": USER, "verbosity": "low"}, "messages").body()
    assert error["error"]["param"] == "verbosity" and error["error"]["code"] == "unsupported_parameter", error


def test_guided_regex_goes_with_auto_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = ChatCompletionBody.model_validate({"model": "m", "messages": USER, "tools": tools, "guided_regex": "x+"})
    spec = body.guided_spec()
    assert spec is not None and spec.regex == "x+" and spec.json_schema is None
    forced = {"model": "m", "messages": USER, "tools": tools, "tool_choice": "required", "guided_regex": "x+"}
    assert rejected(ChatCompletionBody, forced, "messages").body()["error"]["param"] == "guided_regex"
