"""The Batch API carries the issue-15 fields: a line's body becomes a request with its grammar, n, logprobs and
penalties (through ``accept.build_request``), and a result with several choices and logprobs becomes an output
line in OpenAI's shape."""

from __future__ import annotations

from datetime import timedelta

from openai.types.chat import ChatCompletion

from ingress.batches.output import output_line
from ingress.batches.prepare import PreparedLine, build_line_request
from ingress.batches.store import LineOutcome
from ingress.limits import Limits
from schemas import ChoiceResult, FinalResult, InferenceRequest, TokenLogprob, TopLogprob, Usage, utcnow

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


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
    built = build_line_request(
        body,
        endpoint="/v1/chat/completions",
        request_id="b1-L0",
        tenant="t",
        limits=Limits(),
        deadline=utcnow() + timedelta(hours=1),
        known_models=None,
    )
    assert isinstance(built, InferenceRequest), built
    return built


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
