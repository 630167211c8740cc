"""The Batch API carries the issue-15 fields: a line's body becomes a request with its grammar, n, logprobs and
penalties (through ``sluicegate.api.build.build_request``), and a result with several choices and logprobs becomes
an output line in OpenAI's shape; a line with tools gets the ``tool_calls`` the online API answers with."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from openai.types.chat import ChatCompletion

from batch_service.output import output_line
from batch_service.prepare import BuiltLine, PreparedLine, build_line
from schemas import ChoiceResult, FinalResult, InferenceRequest, TokenLogprob, TopLogprob, Usage, utcnow
from sluicegate.api.limits import Limits
from sluicegate.batches.store import LineOutcome

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _built(body: dict[str, Any]) -> BuiltLine:
    built = build_line(
        body,
        endpoint="/v1/chat/completions",
        request_id="b1-L0",
        tenant="t",
        limits=Limits(),
        deadline=utcnow() + timedelta(hours=1),
        known_models=None,
    )
    assert isinstance(built, BuiltLine), built
    return built


def _request() -> InferenceRequest:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "presence_penalty": 0.5,
        "min_p": 0.2,
        "logit_bias": {"3": 1.5},
    }
    built = _built(body)
    assert built.tools is None  # no tools: the output is content
    return built.request


def test_a_batch_line_keeps_its_generation_fields() -> None:
    request = _request()
    assert request.guided is not None and request.guided.json_schema == SCHEMA
    opts = request.sampling
    assert (opts.n, opts.logprobs, opts.presence_penalty, opts.min_p, opts.logit_bias) == (2, 1, 0.5, 0.2, {"3": 1.5})


def test_an_output_line_has_every_choice_and_its_logprobs() -> None:
    request = _request()
    lp = TokenLogprob(token_id=5, token='{"', logprob=-0.3, top=[TopLogprob(token_id=5, token='{"', logprob=-0.3)])
    choices = [
        ChoiceResult(index=0, text='{"a": 1}', token_ids=[5], finish_reason="stop", logprobs=[lp]),
        ChoiceResult(index=1, text='{"a": 22}', token_ids=[5], finish_reason="length", logprobs=[lp]),
    ]
    result = FinalResult(
        request_id="b1-L0",
        model="m",
        tenant="t",
        text='{"a": 1}',
        token_ids=[5],
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        choices=choices,
        worker_id="w",
        created_at=utcnow(),
    )
    line = PreparedLine(line=0, custom_id="c0", request=request)
    out = output_line("b1", line, LineOutcome(result=result), "/v1/chat/completions")
    assert out.response is not None
    body = ChatCompletion.model_validate(out.response.body)
    assert [(c.index, c.message.content, c.finish_reason) for c in body.choices] == [
        (0, '{"a": 1}', "stop"),
        (1, '{"a": 22}', "length"),
    ]
    assert body.choices[1].logprobs is not None and body.choices[1].logprobs.content[0].top_logprobs[0].token == '{"'


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _result(text: str) -> FinalResult:
    return FinalResult(
        request_id="b1-L0", model="m", tenant="t", text=text, token_ids=[5], finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5), worker_id="w", created_at=utcnow(),
    )  # fmt: skip


def _output_body(tool_choice: Any, text: str, fmt: Any = None) -> ChatCompletion:
    built = _built({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                    "tool_choice": tool_choice})  # fmt: skip
    assert built.tools is not None
    # The plan survives the prepared file's JSON round trip.
    line = PreparedLine.model_validate_json(
        PreparedLine(line=0, custom_id="c0", request=built.request, tools=built.tools).model_dump_json()
    )
    out = output_line("b1", line, LineOutcome(result=_result(text)), "/v1/chat/completions", fmt)
    assert out.response is not None
    return ChatCompletion.model_validate(out.response.body)


def test_a_named_tool_choice_line_answers_with_its_tool_call() -> None:
    body = _output_body({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}')
    (choice,) = body.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')


def test_an_auto_tool_call_is_read_in_the_models_advertised_format() -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    body = _output_body("auto", text, fmt="hermes")
    (choice,) = body.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Rome"}'
    # Text that is no call of an offered tool stays content.
    plain = _output_body("auto", "No tools needed.", fmt="hermes").choices[0]
    assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == ("stop", "No tools needed.", None)


def test_max_tokens_over_the_models_context_is_the_online_refusal() -> None:
    """A line's ``max_tokens`` is checked against its model's context as online: an explicit one over it is the
    same 400 naming ``max_tokens`` (not an error from the worker minutes later), a default is lowered to it."""
    line = {"model": "m", "messages": [{"role": "user", "content": "Say a word."}]}
    common: dict[str, Any] = {
        "endpoint": "/v1/chat/completions",
        "request_id": "b1-L0",
        "tenant": "t",
        "limits": Limits(),
        "deadline": utcnow() + timedelta(hours=1),
        "known_models": None,
        "contexts": {"m": 64},
    }
    refused = build_line(line | {"max_tokens": 9000}, **common)
    assert isinstance(refused, LineOutcome) and (refused.status_code, refused.param) == (400, "max_tokens")
    assert refused.code == "context_length_exceeded"
    assert refused.message == "'max_tokens' is 9000, more than the model's context length of 64 tokens."
    lowered = build_line(line, **common)
    assert isinstance(lowered, BuiltLine) and lowered.request.sampling.max_tokens == 64
    fits = build_line(line | {"max_tokens": 10}, **common)
    assert isinstance(fits, BuiltLine) and fits.request.sampling.max_tokens == 10
