"""The ``<think>`` reasoning split: whole and streamed (tags cut at every byte) agree, tags never leak into either
part, a span the prompt opened starts in reasoning, and chat choices carry ``reasoning_content`` with tool calls
still read from the answer."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import DoneEvent, TokenEvent, Usage, WorkerHeartbeat
from sluicegate.api.assembler import StreamAssembler
from sluicegate.api.openai_choices import ChoiceChunks, ChoicePlan, whole_choices
from sluicegate.api.reasoning import (
    ReasoningPlan,
    ReasoningStream,
    advertised_reasoning_parser,
    prompt_opens_reasoning,
    split_reasoning,
)
from sluicegate.api.tool_calls import ToolPlan

MODEL_OPENS = ReasoningPlan("qwen3", opened=False)
PROMPT_OPENED = ReasoningPlan("qwen3", opened=True)
USAGE = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)

CASES = [
    (MODEL_OPENS, "<think>\nLet me count.\n</think>\n\nThree.", ("Let me count.\n", "Three.")),
    (MODEL_OPENS, "  <think>a<b</think>c", ("a<b", "c")),
    (MODEL_OPENS, "Just an answer, no <think> here.", (None, "Just an answer, no <think> here.")),
    (MODEL_OPENS, "<thin", (None, "<thin")),  # cut short inside the tag: it was text after all
    (MODEL_OPENS, "<think>still thinking when max_tokens came", ("still thinking when max_tokens came", "")),
    (MODEL_OPENS, "<think></think>", (None, "")),
    (MODEL_OPENS, "<think>x</think", ("x</think", "")),
    (MODEL_OPENS, "", (None, "")),
    (PROMPT_OPENED, "\nI think so.</think>\n\nYes.", ("I think so.", "Yes.")),
    (PROMPT_OPENED, "no close tag at all", ("no close tag at all", "")),
    (PROMPT_OPENED, "a</think>b</think>c", ("a", "b</think>c")),  # only the first closing tag ends the span
]


@pytest.mark.parametrize(("plan", "text", "want"), CASES)
def test_the_whole_split(plan: ReasoningPlan, text: str, want: tuple[str | None, str]) -> None:
    assert split_reasoning(text, plan) == want


@pytest.mark.parametrize(("plan", "text", "want"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_streamed_pieces_add_up_to_the_whole_split(
    plan: ReasoningPlan, text: str, want: tuple[str | None, str], size: int
) -> None:
    """Fed in pieces of every size (a tag split across tokens), the pieces add up to the whole split, and no
    piece of reasoning ends in what may be the start of its closing tag."""
    stream = ReasoningStream(plan)
    reasoning, content = [], []
    for start in range(0, len(text), size):
        r, c = stream.feed(text[start : start + size])
        reasoning.append(r)
        content.append(c)
        assert not r.endswith(("<", "</", "</t"))  # a closing tag in the making is held back
    r, c = stream.finish()
    reasoning.append(r)
    content.append(c)
    assert ("".join(reasoning) or None, "".join(content)) == want


def test_no_part_of_a_closing_tag_is_relayed_before_it_is_whole() -> None:
    stream = ReasoningStream(MODEL_OPENS)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>plan") == ("plan", "")
    assert stream.feed(" more</th") == (" more", "")  # "</th" held: it may close the span
    assert stream.feed("ink>\n\n") == ("", "")  # whitespace after the tag is dropped
    assert stream.feed("Answer") == ("", "Answer")
    assert stream.finish() == ("", "")


def test_a_held_prefix_that_turns_out_not_to_be_a_tag_is_released() -> None:
    stream = ReasoningStream(MODEL_OPENS)
    assert stream.feed("<t") == ("", "")
    assert stream.feed("able>") == ("", "<table>")
    stream = ReasoningStream(PROMPT_OPENED)
    assert stream.feed("a </") == ("a ", "")
    assert stream.feed("b>") == ("</b>", "")


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking false
        ("<|im_start|>assistant\n", False),
    ],
)
def test_whether_the_prompt_opened_the_span(prompt: str, opened: bool) -> None:
    assert prompt_opens_reasoning(prompt) is opened


def _beat(worker: str, parser: Any) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker,
        model="m",
        running=0,
        waiting=0,
        free_kv_blocks=1,
        total_kv_blocks=1,
        prefix_cache_hit_rate=0.0,
        reasoning_parser=parser,
    )


def test_the_advertised_parser_is_the_one_all_workers_name() -> None:
    assert advertised_reasoning_parser([_beat("a", "qwen3"), _beat("b", None)]) == "qwen3"
    assert advertised_reasoning_parser([_beat("a", "qwen3"), _beat("b", "deepseek_r1")]) is None
    assert advertised_reasoning_parser([]) is None


def _chat(plan: ChoicePlan, pieces: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events: list[Any] = [TokenEvent(request_id="r", seq=i, text=piece, token_ids=[i]) for i, piece in enumerate(pieces)]
    events.append(DoneEvent(request_id="r", seq=len(pieces), finish_reason="stop", usage=USAGE))
    assembler = StreamAssembler()
    chunks = ChoiceChunks(plan)
    streamed = chunks.opening() + [c for e in events for c in chunks.feed(assembler.feed_choices(e))]
    streamed += chunks.close_all(assembler)
    (whole,) = whole_choices(assembler, plan)
    return [c["delta"] for c in streamed], whole


def test_chat_choices_carry_reasoning_content_whole_and_streamed() -> None:
    plan = ChoicePlan("chat", reasoning=MODEL_OPENS)
    deltas, whole = _chat(plan, ["<th", "ink>", "Two plus", " two.</", "think>", "\n\nFour", "."])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two plus two."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    assert not any("think>" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)
    assert whole["message"]["reasoning_content"] == "Two plus two."
    assert whole["message"]["content"] == "Four."
    # Without a parser the tags are the answer's text, and no reasoning_content field is added.
    _, plain = _chat(ChoicePlan("chat"), ["<think>x</think>y"])
    assert plain["message"]["content"] == "<think>x</think>y" and "reasoning_content" not in plain["message"]


def test_tool_calls_are_read_from_the_answer_after_the_reasoning() -> None:
    tools = ToolPlan("auto", None, frozenset({"get_weather"}), "hermes")
    plan = ChoicePlan("chat", tools=tools, reasoning=MODEL_OPENS)
    text = '<think>Need the weather.</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    deltas, whole = _chat(plan, [text[i : i + 4] for i in range(0, len(text), 4)] + ["</tool_call>"])
    assert whole["message"]["reasoning_content"] == "Need the weather."
    assert whole["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
    assert any(d.get("tool_calls") for d in deltas)
