"""From stream events to OpenAI objects: de-duplication, restarts, and the exact shapes the official
``openai`` client parses."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from schemas import DoneEvent, ErrorEvent, RestartEvent, TokenEvent, Usage
from sluicegate.api.assembler import StreamAssembler
from sluicegate.api.openai_format import SSE_DONE, ResponseIds, sse

USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8, cached_tokens=2)


def tok(seq: int, text: str) -> TokenEvent:
    return TokenEvent(request_id="r", seq=seq, text=text, token_ids=[seq])


def done(seq: int, reason: str = "stop") -> DoneEvent:
    return DoneEvent(request_id="r", seq=seq, finish_reason=reason, usage=USAGE)  # type: ignore[arg-type]


def test_events_fold_into_text_once_each() -> None:
    assembler = StreamAssembler()
    relayed = [assembler.feed(e) for e in (tok(0, "Hel"), tok(1, "lo"), tok(1, "lo"), tok(0, "Hel"), tok(2, "!"))]
    assert relayed == ["Hel", "lo", "", "", "!"]
    assert assembler.text == "Hello!" and assembler.completion_tokens == 3
    assembler.feed(done(3))
    assert assembler.finished and assembler.done is not None
    assert assembler.feed(tok(4, "late")) == "" and assembler.text == "Hello!"


def test_restart_drops_text_and_regeneration_is_relayed_past_what_was_sent() -> None:
    assembler = StreamAssembler()
    assert assembler.feed(tok(0, "Hello")) == "Hello"
    assert assembler.feed(tok(1, " wor")) == " wor"
    assert assembler.feed(RestartEvent(request_id="r", seq=2, discard_after_seq=0)) == ""
    assert assembler.text == "Hello"
    assert assembler.feed(tok(3, " wo")) == ""  # still behind what the client has
    assert assembler.feed(tok(4, "rld")) == "ld"
    assert assembler.text == "Hello world" and not assembler.diverged


def test_restart_that_contradicts_sent_text_is_flagged() -> None:
    assembler = StreamAssembler()
    assembler.feed(tok(0, "Yes"))
    assembler.feed(RestartEvent(request_id="r", seq=1, discard_after_seq=-1))
    assert assembler.feed(tok(2, "No")) == ""
    assert assembler.diverged
    # Without streaming, the final text is still right.
    assert assembler.text == "No"


def test_error_event_is_terminal() -> None:
    assembler = StreamAssembler()
    assembler.feed(tok(0, "a"))
    assembler.feed(ErrorEvent(request_id="r", seq=1, code="deadline_exceeded", message="too late"))
    assert assembler.finished and assembler.error is not None and assembler.done is None


def test_chat_chunks_parse_as_openai_chunks() -> None:
    ids = ResponseIds("chat", "abc", "llama", 1700000000)
    first = ChatCompletionChunk.model_validate(ids.chunk(role=True, include_usage=True))
    assert first.id == "chatcmpl-abc" and first.choices[0].delta.role == "assistant"
    middle = ChatCompletionChunk.model_validate(ids.chunk(text="Hi", include_usage=True))
    assert middle.choices[0].delta.content == "Hi" and middle.choices[0].finish_reason is None
    assert middle.usage is None
    last = ChatCompletionChunk.model_validate(ids.chunk(finish_reason="length"))
    assert last.choices[0].finish_reason == "length" and last.choices[0].delta.content is None
    usage = ChatCompletionChunk.model_validate(ids.usage_chunk(USAGE))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 8
    assert usage.usage.prompt_tokens_details is not None and usage.usage.prompt_tokens_details.cached_tokens == 2


def test_whole_responses_parse_as_openai_objects() -> None:
    chat = ChatCompletion.model_validate(ResponseIds("chat", "a", "m", 1).response("Hi!", "stop", USAGE))
    assert chat.object == "chat.completion" and chat.choices[0].message.content == "Hi!"
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    completion = Completion.model_validate(ResponseIds("completion", "a", "m", 1).response("Hi", "length", USAGE))
    assert completion.id == "cmpl-a" and completion.choices[0].text == "Hi"
    assert completion.choices[0].finish_reason == "length"
    # OpenAI's type insists on a finish_reason; the API itself sends null until the last chunk.
    chunk = ResponseIds("completion", "a", "m", 1).chunk(text="x")
    assert chunk["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]
    last = Completion.model_validate(ResponseIds("completion", "a", "m", 1).chunk(finish_reason="stop"))
    assert last.object == "text_completion" and last.choices[0].text == ""


def test_sse_framing() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert json.loads(sse({"x": 1})[len("data: ") :]) == {"x": 1}
    assert SSE_DONE == "data: [DONE]\n\n"
