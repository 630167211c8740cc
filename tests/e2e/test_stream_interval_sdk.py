"""The stream interval seen by the official ``openai`` SDK: the tokens between a request's first and its end arrive
in fewer chunks, and nothing else a client sees changes (the text, the usage, the running usage)."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import MODEL_NAME, Pipeline


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    # Far longer than a request: its first token goes alone, every later one with its end.
    return {"SLUICEGATE_STREAM_INTERVAL_MS": "60000"}


def test_a_streamed_completion_arrives_in_two_chunks_with_the_same_text_and_usage(pipeline: Pipeline) -> None:
    client = pipeline.openai()
    ask: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": "The interval holds tokens back",
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**ask)
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    chunks = list(
        client.completions.create(
            **ask, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        )
    )
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert "".join(c.choices[0].text for c in with_text) == whole.choices[0].text
    # One token event for the first token, one for the other 23 (a chunk without text is an end or usage chunk).
    assert len(with_text) <= 2
    running = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert running[-1] == 24 and running == sorted(running)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
