"""A guided (JSON Schema) request survives ``kill -9`` of its worker mid-stream: the next owner continues it with
the grammar state rebuilt from the delivered tokens (``guided.replay_token_ids``), so the output the client
assembles is one valid JSON document, not a valid prefix followed by a fresh document."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest

from schemas import TokenEvent

from .conftest import Pipeline
from .test_recovery import ensure_workers, wait_owner

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

DIGITS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 120,
    "maxItems": 120,
}


@pytest.fixture(scope="module")
def tiny_model_dir(paced_model_dir: Path) -> Path:
    """Generation must last long enough to kill a worker in the middle of it."""
    return paced_model_dir


@pytest.fixture(scope="module")
def pipeline_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1"}


def test_json_schema_output_stays_valid_across_a_worker_crash(pipeline: Pipeline) -> None:
    ensure_workers(pipeline)
    accepted = pipeline.submit(
        prompt="Count with me", max_tokens=1000, temperature=1.0, seed=11, guided={"json_schema": DIGITS}
    )
    rid = accepted["request_id"]
    owner = wait_owner(pipeline, rid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tokens = [e for e in pipeline.stream_events(rid) if isinstance(e, TokenEvent)]
        if len(tokens) >= 40:
            break
        time.sleep(0.01)
    pipeline.kill(pipeline.find(owner))
    delivered = pipeline.stream_events(rid)
    assert delivered and delivered[-1].type == "token", "the worker was not killed mid-generation"
    events = pipeline.wait_stream_end(rid, timeout_s=120)
    assert events[-1].type == "done", events[-1]
    assert "restart" not in {e.type for e in events}, "the request was continued, not started over"
    assert [e.seq for e in events] == list(range(len(events)))
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert text.startswith("".join(e.text for e in delivered if isinstance(e, TokenEvent)))
    jsonschema.validate(json.loads(text), DIGITS)
    assert pipeline.record(rid).worker_id != owner
