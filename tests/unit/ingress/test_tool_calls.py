"""Reading tool calls from generated text, whole and streamed, for each tool_choice and model format; and the
per-choice assembly that feeds it."""

from __future__ import annotations

import json
from typing import Any

from ingress.assembler import StreamAssembler
from ingress.openai_choices import ChoiceChunks, ChoicePlan, whole_choices
from ingress.tool_calls import ToolCallStream, ToolPlan, parse_output
from schemas import DoneEvent, TokenEvent, TokenLogprob, Usage

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


def test_streamed_hermes_sends_content_then_whole_calls() -> None:
    text = 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # the marker arrives split
    deltas, called = _stream(HERMES, pieces)
    content, calls = _reassemble(deltas)
    assert called and content == "Sure " and [(n, json.loads(a)) for n, a in calls] == [("get_time", {"zone": "utc"})]
    assert not any("<tool" in (d.get("content") or "") for d in deltas)


def test_streamed_prose_with_a_lookalike_is_all_content() -> None:
    deltas, called = _stream(HERMES, ["a <to", "ol> b"])
    assert not called and _reassemble(deltas) == ("a <tool> b", [])
    deltas, called = _stream(LLAMA, ["  {not", " a call}"])
    assert not called and _reassemble(deltas)[0] == "  {not a call}"


def test_streamed_named_call_sends_header_then_argument_fragments() -> None:
    deltas, called = _stream(ToolPlan("named", "get_weather", NAMES), ['{"ci', 'ty": ', '"Oslo"}'])
    assert called and len(deltas) == 4
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0] for d in deltas[1:]] == [
        {"index": 0, "function": {"arguments": p}} for p in ['{"ci', 'ty": ', '"Oslo"}']
    ]


USAGE = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)


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
