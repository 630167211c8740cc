"""Reading tool calls from generated text, whole and streamed, for each tool_choice and model format; and the
per-choice assembly that feeds it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import DoneEvent, TokenEvent, TokenLogprob, Usage
from sluicegate.api.assembler import StreamAssembler
from sluicegate.api.openai_choices import ChoiceChunks, ChoicePlan, whole_choices
from sluicegate.api.tool_call_stream import ToolCallStream
from sluicegate.api.tool_calls import ToolPlan, parse_output

NAMES = frozenset({"get_weather", "get_time"})
HERMES = ToolPlan("auto", None, NAMES, "hermes")
LLAMA = ToolPlan("auto", None, NAMES, "llama3_json")


def _calls(calls: list[dict[str, Any]] | None) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


def test_hermes_calls_after_content() -> None:
    text = (
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_output(text, HERMES)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls or [])


def test_llama_json_calls_with_and_without_python_tag() -> None:
    for text in (
        '{"name": "get_time", "parameters": {"zone": "utc"}}',
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}',
    ):
        content, calls = parse_output(text, LLAMA)
        assert content is None and _calls(calls) == [("get_time", {"zone": "utc"})]
    both = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "x"}}'
    assert [n for n, _ in _calls(parse_output(both, LLAMA)[1])] == ["get_time", "get_weather"]


def test_text_nested_too_deeply_to_parse_stays_content() -> None:
    deep = "[" * 3000 + "]" * 3000
    assert parse_output(deep, ToolPlan("required", None, NAMES)) == (deep, None)
    hermes = "<tool_call>" + deep + "</tool_call>"
    assert parse_output(hermes, HERMES) == (hermes, None)
    llama = '{"a":' * 3000 + "1" + "}" * 3000
    assert parse_output(llama, LLAMA) == (llama, None)


def test_text_that_is_not_a_call_of_an_offered_tool_stays_content() -> None:
    for text, plan in [
        ("Just prose.", HERMES),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', HERMES),
        ("<tool_call>{not json</tool_call>", HERMES),
        ('{"name": "unknown", "parameters": {}}', LLAMA),
        ('{"answer": 42}', LLAMA),
    ]:
        assert parse_output(text, plan) == (text, None)


def test_required_and_named_plans() -> None:
    required = ToolPlan("required", None, NAMES)
    content, calls = parse_output('[{"name": "get_time", "parameters": {"zone": "cet"}}]', required)
    assert content is None and _calls(calls) == [("get_time", {"zone": "cet"})]
    assert parse_output('[{"name": "get_ti', required) == ('[{"name": "get_ti', None)  # cut short: content
    named = ToolPlan("named", "get_weather", NAMES)
    assert _calls(parse_output('{"city": "Rome"}', named)[1]) == [("get_weather", {"city": "Rome"})]


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[list[dict[str, Any]], bool]:
    stream = ToolCallStream(plan)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish(), stream.called


def _reassemble(deltas: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                entry[0] = call["function"]["name"]
            entry[1] += call["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


REQUIRED = ToolPlan("required", None, NAMES)
AUTO_ANY = ToolPlan("auto", None, NAMES, None)  # the worker advertised no format: both are read

STREAMED_CASES = [
    (HERMES, 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'),
    (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"slo}", "days": [1, {"x": 2}]}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    ),
    (LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "utc"}}'),
    (LLAMA, ' {"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "x"}}'),
    (AUTO_ANY, '{"name": "get_time", "parameters": {"zone": 5}}'),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}</tool_call>'),
    (AUTO_ANY, 'Hi <tool_call>{"name": "get_time", "arguments": {"zone": 1.5}}</tool_call>'),
    (REQUIRED, '[{"name": "get_time", "parameters": {"zone": "cet"}}, {"name": "get_weather", "parameters": {}}]'),
]


@pytest.mark.parametrize(("plan", "text"), STREAMED_CASES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_whole_reading(plan: ToolPlan, text: str, size: int) -> None:
    deltas, called = _stream(plan, [text[i : i + size] for i in range(0, len(text), size)])
    content, calls = _reassemble(deltas)
    whole_content, whole_calls = parse_output(text, plan)
    assert called and content.strip() == (whole_content or "")  # whole, the content is stripped
    assert [(n, json.loads(a)) for n, a in calls] == _calls(whole_calls)
    assert not any("<tool" in (d.get("content") or "") or "python_tag" in (d.get("content") or "") for d in deltas)
    heads = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert [h["index"] for h in heads] == list(range(len(heads)))
    assert all(h["type"] == "function" and h["function"]["arguments"] == "" for h in heads)


def test_arguments_stream_while_the_call_is_written() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
    stream = ToolCallStream(HERMES)
    sent: list[dict[str, Any]] = []
    for i, char in enumerate(text):
        sent += stream.feed(char)
        if text[: i + 1].endswith('"arguments": {"ci'):
            head = sent[0]["tool_calls"][0]
            assert head["function"]["name"] == "get_weather", "the header goes out once the name is known"
            assert _reassemble(sent)[1] == [("get_weather", '{"ci')], "fragments go out as they arrive"
    assert stream.finish() == []
    assert _reassemble(sent)[1] == [("get_weather", '{"city": "Oslo", "days": 3}')]


def test_streamed_calls_that_cannot_be_followed_are_read_at_the_end() -> None:
    # Keys in another order: held, then read whole (the same calls as parse_output).
    text = '<tool_call>{"arguments": {"zone": "x"}, "name": "get_time"}</tool_call>'
    deltas, called = _stream(HERMES, [text[i : i + 4] for i in range(0, len(text), 4)])
    assert called and _reassemble(deltas) == ("", [("get_time", '{"zone": "x"}')])
    # A tool that was not offered, or a block that is not JSON: content, as read whole.
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>"):
        deltas, called = _stream(HERMES, [text[i : i + 2] for i in range(0, len(text), 2)])
        assert not called and _reassemble(deltas) == (text, [])


def test_a_call_cut_short_keeps_what_was_streamed() -> None:
    deltas, called = _stream(HERMES, ['ok <tool_call>{"name": "get_time", "arguments": {"zo'])
    assert called and _reassemble(deltas) == ("ok ", [("get_time", '{"zo')])


def test_streamed_named_call_sends_header_then_argument_fragments() -> None:
    deltas, called = _stream(ToolPlan("named", "get_weather", NAMES), ['{"ci', 'ty": ', '"Oslo"}'])
    assert called and len(deltas) == 4
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0] for d in deltas[1:]] == [
        {"index": 0, "function": {"arguments": p}} for p in ['{"ci', 'ty": ', '"Oslo"}']
    ]


@pytest.mark.parametrize(
    ("plan", "text"),
    [
        (ToolPlan("named", "get_weather", NAMES), '{"city": "Os'),
        (HERMES, 'ok <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'),
    ],
    ids=["named", "auto"],
)
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_call_ends_with_tool_calls_only_when_the_model_finished_it(plan: ToolPlan, text: str, reason: str) -> None:
    """A choice with calls that ``max_tokens`` cut keeps ``length`` (a forced call's arguments may not parse),
    whole and streamed; one the model finished says ``tool_calls``."""
    events = [
        TokenEvent(request_id="r", seq=0, text=text, token_ids=[1]),
        DoneEvent(request_id="r", seq=1, finish_reason=reason, usage=USAGE),  # type: ignore[arg-type]
    ]
    assembler = StreamAssembler()
    chunks = ChoiceChunks(ChoicePlan("chat", tools=plan))
    streamed = [c for e in events for c in chunks.feed(assembler.feed_choices(e))] + chunks.close_all(assembler)
    want = "tool_calls" if reason == "stop" else "length"
    assert [c["finish_reason"] for c in streamed if c["finish_reason"]] == [want]
    (whole,) = whole_choices(assembler, ChoicePlan("chat", tools=plan))
    assert whole["finish_reason"] == want and whole["message"]["tool_calls"]


USAGE = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('[{"name": "get_weather", "parameters": {"city": "gab', [("get_weather", '{"city": "gab')]),
        (
            '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',
            [
                ("get_time", "{}"),
                ("get_weather", '{"ci'),
            ],
        ),
        ('[{"name": "', []),  # cut before a name ended: no call yet, and the grammar's list is not content
    ],
    ids=["in-arguments", "second-call", "in-name"],
)
def test_a_required_call_cut_short_is_the_same_whole_and_streamed(text: str, calls: list[tuple[str, str]]) -> None:
    """``tool_choice: required`` cut by ``max_tokens``: the calls written so far as ``tool_calls`` (the arguments
    as far as they go), never the grammar's JSON list as content, whole as streamed (whole once said content)."""
    plan = ToolPlan("required", None, NAMES)
    events = [
        TokenEvent(request_id="r", seq=0, text=text, token_ids=[1]),
        DoneEvent(request_id="r", seq=1, finish_reason="length", usage=USAGE),
    ]
    assembler = StreamAssembler()
    chunks = ChoiceChunks(ChoicePlan("chat", tools=plan))
    streamed = [c for e in events for c in chunks.feed(assembler.feed_choices(e))] + chunks.close_all(assembler)
    assert _reassemble([c["delta"] for c in streamed]) == ("", calls)
    (whole,) = whole_choices(assembler, ChoicePlan("chat", tools=plan))
    message = whole["message"]
    assert message["content"] is None and whole["finish_reason"] == "length"
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert got == calls and all(c["id"].startswith("call_") for c in message.get("tool_calls", []))


def _lp(token_id: int) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=token_id, token=f"t{token_id}", logprob=-0.5)]


def test_choices_are_assembled_and_closed_on_their_own() -> None:
    events = [
        TokenEvent(request_id="r", seq=0, text="a", token_ids=[1], index=0, logprobs=_lp(1)),
        TokenEvent(request_id="r", seq=1, text="b", token_ids=[2], index=1, logprobs=_lp(2), finish_reason="length"),
        TokenEvent(request_id="r", seq=2, text="c", token_ids=[3], index=0, logprobs=_lp(3), finish_reason="stop"),
        DoneEvent(request_id="r", seq=3, finish_reason="stop", usage=USAGE),
    ]
    assembler = StreamAssembler()
    chunks = ChoiceChunks(ChoicePlan("chat", n=2, logprobs=True))
    streamed = [c for e in events for c in chunks.feed(assembler.feed_choices(e))] + chunks.close_all(assembler)
    ends = [(c["index"], c["finish_reason"]) for c in streamed if c["finish_reason"]]
    assert ends == [(1, "length"), (0, "stop")]
    whole = whole_choices(assembler, ChoicePlan("chat", n=2, logprobs=True))
    assert [(c["message"]["content"], c["finish_reason"]) for c in whole] == [("ac", "stop"), ("b", "length")]
    assert [e["token"] for e in whole[0]["logprobs"]["content"]] == ["t1", "t3"]


def test_one_choice_event_json_is_unchanged() -> None:
    event = TokenEvent(request_id="r", seq=0, text="x", token_ids=[1])
    assert event.model_dump_json() == '{"request_id":"r","seq":0,"type":"token","text":"x","token_ids":[1]}'
