"""The Responses API without a backbone: bodies (what is refused and how, the chat body a request becomes), the
conversation's chat messages, and the events derived from a request's stream (order, numbering, determinism)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from ingress.responses.bodies import ResponseCreateBody, chat_body
from ingress.responses.events import ResponseEvents
from ingress.responses.items import chat_messages, stored_items, with_ids
from ingress.responses.objects import PlanSpec, ResponseRecord
from ingress.responses.relay import cancelled
from schemas import DoneEvent, ErrorEvent, RestartEvent, StreamEvent, TokenEvent, Usage
from sluicegate.api.errors import ApiError, invalid

RID = "0123456789abcdef0123456789abcdef"
USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)


def parsed(**body: Any) -> ResponseCreateBody:
    return ResponseCreateBody.model_validate({"model": "m", "input": "hi"} | body)


def refused(**body: Any) -> ApiError:
    with pytest.raises(ValidationError) as info:
        parsed(**body)
    return invalid(info.value, root_field="input")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools.0"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"moderation": {}}, "moderation"),
    ],
)
def test_unsupported_fields_are_a_400_naming_them(body: dict[str, Any], param: str) -> None:
    error = refused(**body)
    assert (error.status, error.code, error.param) == (400, "unsupported_parameter", param), error.message


def test_inert_values_are_accepted() -> None:
    body = parsed(reasoning=None, include=[], truncation="disabled", top_logprobs=0, service_tier="auto", user="u")
    assert body.stored and not body.background


def test_a_request_becomes_a_chat_body() -> None:
    body = parsed(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}],
        instructions="Be brief.",
        max_output_tokens=40,
        temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    items = stored_items(body.input)  # type: ignore[arg-type]
    chat = chat_body(body, chat_messages(items, body.instructions))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.resolved_max_tokens() == 40 and chat.temperature == 0
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    guided = chat.guided_spec()
    assert guided is not None and guided.json_schema == {"type": "object"}  # the named call's arguments

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = parsed(text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    guided = chat_body(structured, [{"role": "user", "content": "x"}]).guided_spec()
    assert guided is not None and guided.json_schema == schema


def test_chat_errors_name_the_responses_parameter() -> None:
    body = parsed(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"})
    with pytest.raises(ApiError) as info:
        chat_body(body, [{"role": "user", "content": "x"}])
    assert info.value.param == "tool_choice" and "'g'" in info.value.message
    bad = parsed(
        text={"format": {"type": "json_object"}}, tools=[{"type": "function", "name": "f"}], tool_choice="required"
    )
    with pytest.raises(ApiError) as info:
        chat_body(bad, [{"role": "user", "content": "x"}])
    assert info.value.param == "text.format", info.value.message


def test_conversation_items_become_chat_messages() -> None:
    items = with_ids(
        stored_items(
            [  # type: ignore[arg-type]
                *parsed(
                    input=[
                        {"role": "user", "content": "Weather in Oslo?"},
                        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hm."}]},
                        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                        {
                            "type": "function_call_output",
                            "call_id": "c2",
                            "output": [{"type": "input_text", "text": "9"}],
                        },
                    ]
                ).input
            ]
        ),
        RID,
    )
    assert [item["id"] for item in items][:2] == [f"msg_{RID}_in0", f"msg_{RID}_in1"]
    messages = chat_messages(items, "Sys.")
    assert [(m["role"], m.get("content")) for m in messages] == [
        ("system", "Sys."),
        ("user", "Weather in Oslo?"),
        ("assistant", "Hm."),
        ("tool", "sunny"),
        ("tool", "9"),
    ]
    assert [call["id"] for call in messages[2]["tool_calls"]] == ["c1", "c2"]
    orphan = [{"id": "x", "type": "function_call_output", "call_id": "nope", "output": "o", "status": "completed"}]
    with pytest.raises(ApiError) as info:
        chat_messages(orphan, None)
    assert (info.value.status, info.value.param) == (400, "input")


# --- events -------------------------------------------------------------------------------------------------
def record(*, background: bool = False, plan: PlanSpec | None = None) -> ResponseRecord:
    return ResponseRecord(
        id=f"resp_{RID}",
        request_id=RID,
        tenant="t",
        created_at=1,
        model="m",
        background=background,
        plan=plan or PlanSpec(),
    )


def tokens(*texts: str, start: int = 0) -> list[StreamEvent]:
    return [TokenEvent(request_id=RID, seq=start + n, text=t, token_ids=[n]) for n, t in enumerate(texts)]


def done(seq: int, reason: str = "stop") -> DoneEvent:
    return DoneEvent(request_id=RID, seq=seq, finish_reason=reason, usage=USAGE)  # type: ignore[arg-type]


def derive(rec: ResponseRecord, stream: list[StreamEvent]) -> tuple[list[dict[str, Any]], ResponseEvents]:
    builder = ResponseEvents(rec)
    events = builder.opening()
    for event in stream:
        events += builder.feed(event)
    return events, builder


def test_text_events_in_openai_order_numbered_from_zero() -> None:
    events, builder = derive(record(background=True), [*tokens("Hel", "lo"), done(2)])
    assert [e["type"] for e in events] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "queued" and events[2]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert final == builder.response() and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][0]["id"] == f"msg_{RID}_0"
    assert final["usage"]["output_tokens"] == 3 and events[3]["item"]["content"] == []  # copies, not later state


def test_the_same_stream_always_gives_the_same_events() -> None:
    """Redelivered entries, a restart, and whichever ingress reads: one derivation (what resume relies on)."""
    stream: list[StreamEvent] = [
        *tokens("a", "b"),
        RestartEvent(request_id=RID, seq=2, discard_after_seq=0),
        *tokens("b", "c", start=3),
        done(5),
    ]
    once, _ = derive(record(), stream)
    twice, _ = derive(record(), [stream[0], stream[0], stream[1], *stream[1:]])  # duplicates are dropped by seq
    assert once == twice
    text = "".join(e["delta"] for e in once if e["type"] == "response.output_text.delta")
    assert text == "abc"


def test_endings() -> None:
    events, builder = derive(record(), [*tokens("x"), done(1, "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert builder.status == "incomplete" and builder.incomplete_details == {"reason": "max_output_tokens"}
    assert builder.output[0]["status"] == "incomplete"
    events, builder = derive(record(), [*tokens("x"), done(1, "abort")])
    assert events[-1]["type"] == "response.incomplete" and builder.status == "cancelled"
    failure = ErrorEvent(request_id=RID, seq=1, code="context_length_exceeded", message="too long")
    events, builder = derive(record(), [*tokens("x"), failure])
    assert events[-1]["type"] == "response.failed" and builder.status == "failed"
    assert builder.error == {"code": "invalid_prompt", "message": "too long"}
    assert builder.failure == ("context_length_exceeded", "too long")
    events, builder = derive(record(), [done(0)])  # nothing said: still one (empty) message
    assert builder.output[0]["content"][0]["text"] == "" and events[-1]["type"] == "response.completed"


def test_tool_calls_are_items_with_ids_from_the_request() -> None:
    plan = PlanSpec(mode="auto", tool_names=["get_weather"], fmt="hermes")
    said = tokens(
        "Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}', "</tool_call>"
    )
    events, builder = derive(record(plan=plan), [*said, done(5)])
    message, call = builder.output
    assert message["content"][0]["text"] == "Let me check. "
    assert (call["type"], call["name"], call["call_id"], call["id"]) == (
        "function_call",
        "get_weather",
        f"call_{RID}_0",
        f"fc_{RID}_1",
    )
    assert call["arguments"] == '{"city": "Oslo"}'
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    again, _ = derive(record(plan=plan), [*said, done(5)])
    assert again == events


def test_a_json_schema_format_needs_its_schema() -> None:
    # OpenAI requires it for the Responses API; without it the output would quietly be "any JSON".
    error = refused(text={"format": {"type": "json_schema", "name": "thing"}})
    assert (error.status, error.code, error.param) == (400, "invalid_value", "text.format.schema"), error.message
    assert "required" in error.message.lower()


def test_a_response_cancelled_before_its_worker_ended_it_leaves_no_item_in_progress() -> None:
    response = {"status": "in_progress", "output": [{"status": "completed"}, {"status": "in_progress"}]}
    cancelled(response)
    assert response == {"status": "cancelled", "output": [{"status": "completed"}, {"status": "incomplete"}]}
