"""The worker's mapping of the issue-15 request fields: SamplingParams (grammar replay on resume), tools and tool
messages through the chat template, the advertised tool-call format, and logprob token text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_workers.engine import TokenLogprob as EngineLogprob
from gpu_workers.worker.prompts import LogprobText, PromptError, prompt_token_ids, sampling_params, tool_call_format
from schemas import InferenceRequest

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _request(**fields: object) -> InferenceRequest:
    base = {"request_id": "r1", "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return InferenceRequest.model_validate(base | fields)


def test_sampling_fields_and_grammar_replay() -> None:
    request = _request(
        sampling={
            "max_tokens": 50,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "min_p": 0.1,
            "logit_bias": {"7": -100.0},
            "logprobs": 3,
            "n": 2,
        },
        guided={"json_schema": {"type": "object"}},
    )
    params = sampling_params(request, already_generated=10, delivered=[5, 6])
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.min_p == 0.1 and params.logit_bias == {7: -100.0} and params.logprobs == 3 and params.n == 2
    assert params.max_tokens == 40
    assert params.guided is not None and params.guided.json_schema == {"type": "object"}
    assert params.guided.replay_token_ids == [5, 6]
    assert sampling_params(_request()).guided is None


class _Tokenizer:
    """Records what the chat template was given."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def apply_chat_template(self, conversation: list, tools: list | None = None, **_: object) -> list[int]:
        self.seen = {"conversation": conversation, "tools": tools}
        return [1, 2, 3]


def test_tools_and_tool_calls_reach_the_chat_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    request = _request(
        messages=[
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
        ],
        tools=[TOOL],
    )
    tokenizer = _Tokenizer()
    assert prompt_token_ids(request, tokenizer) == [1, 2, 3]
    conversation = tokenizer.seen["conversation"]
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "utc"}  # an object for tojson
    assert conversation[2] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
    assert tokenizer.seen["tools"] == [TOOL]


def test_a_developer_message_is_rendered_as_the_system_message() -> None:
    """OpenAI's ``developer`` role is ``system`` renamed; a template that sees another role (SmolLM2's) also adds
    its default system prompt, so the worker and ingress's count both render it as ``system``."""
    request = _request(messages=[{"role": "developer", "content": "One word."}, {"role": "user", "content": "hi"}])
    tokenizer = _Tokenizer()
    prompt_token_ids(request, tokenizer)
    assert [m["role"] for m in tokenizer.seen["conversation"]] == ["system", "user"]


def test_a_template_that_refuses_is_a_prompt_error() -> None:
    tokenizer = _Tokenizer()
    tokenizer.apply_chat_template = lambda *a, **k: (_ for _ in ()).throw(ValueError("no tools here"))  # type: ignore[method-assign]
    with pytest.raises(PromptError, match="no tools here"):
        prompt_token_ids(_request(), tokenizer)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
        ('<|python_tag|>{"name": x, "parameters": y}', "llama3_json"),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_tool_call_format_from_the_template(template: str | None, fmt: str | None) -> None:
    assert tool_call_format(SimpleNamespace(chat_template=template)) == fmt


def test_logprob_text_decodes_each_token_once() -> None:
    calls: list[list[int]] = []

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        calls.append(ids)
        return f"<{ids[0]}>"

    text = LogprobText(SimpleNamespace(decode=decode), token_bytes=lambda t: bytes([t]))
    out = text.convert([EngineLogprob(4, -0.1, [(4, -0.1), (9, float("-inf"))]), EngineLogprob(4, -0.2, [])])
    assert out is not None and [o.token for o in out] == ["<4>", "<4>"]
    assert [(t.token, t.logprob) for t in out[0].top] == [("<4>", -0.1), ("<9>", -9999.0)]
    assert calls == [[4], [9]]
    assert out[0].bytes == [4] and [t.bytes for t in out[0].top] == [[4], [9]]


def test_logprob_bytes_of_a_partial_utf8_character_are_the_tokens_own(tmp_path) -> None:
    from gpu_workers.engine.models.random_checkpoint import build_tokenizer
    from gpu_workers.engine.token_bytes import gpt2_byte_decoder
    from sluicegate.api.openai_format import chat_logprobs

    tokenizer = build_tokenizer(400)
    char_of = {b: c for c, b in gpt2_byte_decoder().items()}
    lead = tokenizer.convert_tokens_to_ids(char_of[0xE2])  # the first byte of "€" (E2 82 AC)
    ascii_token = tokenizer.encode(" the", add_special_tokens=False)[0]
    text = LogprobText(tokenizer)
    out = text.convert([EngineLogprob(lead, -0.5, [(lead, -0.5), (ascii_token, -1.0)])])
    assert tokenizer.decode([ascii_token]) == " the"
    assert out is not None and out[0].token == "\ufffd"  # the text alone cannot carry a partial character
    assert out[0].bytes == [0xE2] and out[0].top[1].bytes == list(b" the")
    content = chat_logprobs(out)["content"][0]
    assert content["bytes"] == [0xE2]
    assert [t["bytes"] for t in content["top_logprobs"]] == [[0xE2], list(b" the")]


def test_legacy_completion_alternatives_include_the_sampled_token() -> None:
    """OpenAI's legacy completions (and vLLM) always give the sampled token's logprob among a position's
    alternatives: up to logprobs + 1 of them when sampling chose one outside the top."""
    from schemas import TokenLogprob, TopLogprob
    from sluicegate.api.openai_format import completion_logprobs

    top = [TopLogprob(token_id=1, token=" a", logprob=-1.0), TopLogprob(token_id=2, token=" the", logprob=-2.0)]
    outside = TokenLogprob(token_id=9, token=" unto", logprob=-7.5, top=top)
    inside = TokenLogprob(token_id=1, token=" a", logprob=-1.0, top=top)
    out = completion_logprobs([outside, inside])
    assert out["top_logprobs"] == [{" a": -1.0, " the": -2.0, " unto": -7.5}, {" a": -1.0, " the": -2.0}]
    assert out["tokens"] == [" unto", " a"] and out["token_logprobs"] == [-7.5, -1.0] and out["text_offset"] == [0, 5]
