"""The Responses API on the real pipeline (router, ingress, result service, two workers of a random-weight model)
with the official ``openai`` client: structured output and a forced function call through the grammar path, and a
background response whose stream is dropped, whose worker is killed (``kill -9``) mid-generation and whose ingress
is killed and restarted, resumed with ``starting_after``: every event once, in order, and the uninterrupted text.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from .conftest import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

INPUT = "Once upon a time in a land far away"
MAX_TOKENS = 300
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Generation must last long enough to kill a worker in the middle of it."""
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    # One intra-op thread per worker: several processes share two cores.
    return {"OMP_NUM_THREADS": "1"}


def _client(pipeline: Pipeline) -> OpenAI:
    return OpenAI(base_url=f"{pipeline.ingress_url}/v1", api_key=pipeline.api_key, max_retries=0, timeout=120)


def test_structured_output_and_a_forced_function_call(pipeline: Pipeline) -> None:
    api = _client(pipeline)
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    person = api.responses.create(
        model=pipeline.model,
        input="Invent a person.",
        text={"format": fmt},  # type: ignore[typeddict-item]
        max_output_tokens=120,
        extra_body={"seed": 3},
    )
    assert person.status == "completed", person.output
    jsonschema.validate(json.loads(person.output_text), PERSON)

    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    called = api.responses.create(
        model=pipeline.model,
        input="Weather in Oslo?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
        extra_body={"seed": 3},
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def _owner(pipeline: Pipeline, request_id: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = pipeline.record(request_id)
        if record is not None and record.status == "running" and record.worker_id:
            return str(record.worker_id)
        time.sleep(0.02)
    raise AssertionError(f"no worker took {request_id}")


def test_background_response_survives_worker_and_ingress_kills(pipeline: Pipeline) -> None:
    pipeline.start_worker("worker-b")
    pipeline.wait_workers(2, timeout_s=120)
    api = _client(pipeline)
    body: dict[str, Any] = {
        "model": pipeline.model,
        "input": INPUT,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    reference = api.responses.create(**body)
    assert reference.status == "incomplete" and reference.usage is not None
    assert reference.usage.output_tokens == MAX_TOKENS

    stream = api.responses.create(**body, background=True, stream=True)
    first: list[Any] = []
    for event in stream:
        first.append(event)
        if sum(e.type == "response.output_text.delta" for e in first) >= 40:
            break
    stream.close()  # the client's connection drops
    response_id = first[0].response.id
    assert first[0].response.status == "queued"
    request_id = response_id.removeprefix("resp_")
    owner = _owner(pipeline, request_id)
    pipeline.kill(pipeline.find(owner))
    assert len(pipeline.stream_events(request_id)) < MAX_TOKENS - 50, "the worker was not killed mid-generation"
    pipeline.kill(pipeline.find("ingress"))
    ingress = pipeline.start("ingress", "ingress")
    pipeline.wait_http(f"{pipeline.ingress_url}/healthz", ingress)

    rest = list(api.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events))), "gap or duplicate"
    assert events[-1].type == "response.incomplete"  # max_output_tokens reached
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == reference.output_text, "the text differs from an uninterrupted run"
    final = api.responses.retrieve(response_id)
    assert final.status == "incomplete" and final.output_text == reference.output_text
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
