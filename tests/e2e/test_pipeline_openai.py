"""Through the whole pipeline (ingress → Kafka → worker → Redis → ingress) with the official client."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from gpu_workers.engine import LLM, SamplingParams

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time in a land far away"]


@pytest.fixture(scope="module")
def engine_reference(tiny_model_dir: Path) -> dict[str, str]:
    """The engine's own greedy output for each prompt, outside the pipeline."""
    llm = LLM(model=str(tiny_model_dir), device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


def _client(pipeline: Pipeline) -> OpenAI:
    return OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=60)


def test_models_lists_the_live_worker(pipeline: Pipeline) -> None:
    assert pipeline.model in [m.id for m in _client(pipeline).models.list()]


def test_completion_equals_engine_output(pipeline: Pipeline, engine_reference: dict[str, str]) -> None:
    client = _client(pipeline)
    for prompt in PROMPTS:
        out = client.completions.create(
            model=pipeline.model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == engine_reference[prompt]
        assert out.usage.completion_tokens == 12


def test_streaming_completion_equals_engine_output(pipeline: Pipeline, engine_reference: dict[str, str]) -> None:
    client = _client(pipeline)
    prompt = PROMPTS[2]
    stream = client.completions.create(
        model=pipeline.model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine_reference[prompt]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_streaming_and_not(pipeline: Pipeline) -> None:
    client = _client(pipeline)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=pipeline.model, messages=messages, max_tokens=10, temperature=0)
    streamed = client.chat.completions.create(
        model=pipeline.model, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert full.choices[0].message.role == "assistant"
    assert "".join(pieces) == full.choices[0].message.content
    assert full.usage.prompt_tokens > 0
