"""The message contracts: strict validation with precise errors, round trips, names, JSON Schema export."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import (
    CancelRequest,
    DoneEvent,
    ErrorEvent,
    InferenceRequest,
    Names,
    RestartEvent,
    TokenEvent,
    Usage,
    WorkerHeartbeat,
    parse_stream_event,
    seq_from_entry_id,
    stream_entry_id,
)
from schemas.export import JSON_DIR, export_schemas, render_schemas
from schemas.names import model_token


def _error_locs(exc: ValidationError) -> set[str]:
    return {".".join(str(p) for p in err["loc"]) for err in exc.errors()}


def test_request_round_trip_through_json() -> None:
    req = InferenceRequest(
        request_id="r-1",
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        priority="interactive",
        deadline=datetime.now(UTC) + timedelta(seconds=5),
    )
    again = InferenceRequest.model_validate_json(req.model_dump_json())
    assert again == req
    assert again.messages[0].text() == "hi"


def test_request_from_foreign_json_with_token_prompt() -> None:
    raw = json.dumps({"request_id": "x", "model": "m", "prompt": [1, 2, 3], "sampling": {"temperature": 0}})
    req = InferenceRequest.model_validate_json(raw)
    assert req.prompt == [1, 2, 3]
    assert req.sampling.temperature == 0.0
    assert req.priority == "standard"


@pytest.mark.parametrize(
    ("patch", "bad_field"),
    [
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature"),
        ({"sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
        ({"priority": "urgent"}, "priority"),
        ({"request_id": "has space"}, "request_id"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"deadline": "2030-01-01T00:00:00"}, "deadline"),  # naive time is ambiguous
        ({"surprise": 1}, "surprise"),
        ({"user": ""}, "user"),
        ({"user": "u" * 257}, "user"),
        ({"user": "line\nbreak"}, "user"),  # control characters would garble logs and keys
        ({"user": 7}, "user"),
    ],
)
def test_violations_name_the_bad_field(patch: dict, bad_field: str) -> None:
    body = {"request_id": "r", "model": "m", "prompt": "hello", **patch}
    with pytest.raises(ValidationError) as info:
        InferenceRequest.model_validate_json(json.dumps(body))
    assert any(loc.startswith(bad_field) for loc in _error_locs(info.value)), info.value


def test_user_is_optional_so_older_producers_are_unaffected() -> None:
    assert InferenceRequest.model_validate_json('{"request_id": "r", "model": "m", "prompt": "a"}').user is None
    req = InferenceRequest.model_validate_json('{"request_id": "r", "model": "m", "prompt": "a", "user": "ana@x é"}')
    assert req.user == "ana@x é"
    assert InferenceRequest.model_validate_json(req.model_dump_json()) == req


def test_exactly_one_of_prompt_and_messages() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'prompt' and 'messages'"):
        InferenceRequest.model_validate_json('{"request_id": "r", "model": "m"}')
    with pytest.raises(ValidationError, match="exactly one"):
        InferenceRequest.model_validate_json(
            '{"request_id": "r", "model": "m", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}'
        )


def test_expired_deadline() -> None:
    past = InferenceRequest(request_id="r", model="m", prompt="a", deadline=datetime.now(UTC) - timedelta(1))
    assert past.expired()
    assert not InferenceRequest(request_id="r", model="m", prompt="a").expired()


def test_stream_events_discriminate_on_type() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    events = [
        TokenEvent(request_id="r", seq=0, text="he", token_ids=[5]),
        DoneEvent(request_id="r", seq=1, finish_reason="stop", usage=usage),
        ErrorEvent(request_id="r", seq=2, code="deadline_exceeded", message="too late"),
        RestartEvent(request_id="r", seq=3, discard_after_seq=-1),
    ]
    for event in events:
        assert parse_stream_event(event.model_dump_json()) == event
    with pytest.raises(ValidationError):
        parse_stream_event('{"type": "nope", "request_id": "r", "seq": 0}')


def test_entry_ids_follow_seq() -> None:
    assert stream_entry_id(0) == "0-1"
    assert [seq_from_entry_id(stream_entry_id(s)) for s in range(5)] == list(range(5))
    assert seq_from_entry_id(b"0-10") == 9
    with pytest.raises(ValueError):
        seq_from_entry_id("1700000000000-0")


def test_heartbeat_and_cancel_validate() -> None:
    hb = WorkerHeartbeat(
        worker_id="w1",
        model="m",
        running=1,
        waiting=0,
        free_kv_blocks=10,
        total_kv_blocks=12,
        prefix_cache_hit_rate=0.5,
    )
    assert WorkerHeartbeat.model_validate_json(hb.model_dump_json()) == hb
    with pytest.raises(ValidationError):
        WorkerHeartbeat.model_validate_json(hb.model_dump_json().replace('"running":1', '"running":-1'))
    assert CancelRequest(request_id="r").reason == "client_cancelled"


def test_names_are_prefixed_and_topic_safe() -> None:
    names = Names("t1.")
    assert names.request_topic("tiny", "interactive") == "t1.llm.tiny.interactive"
    assert names.request_topics("tiny") == [f"t1.llm.tiny.{t}" for t in ("interactive", "standard", "batch")]
    assert names.stream_key("abc") == "t1.llm:stream:abc"
    hub = model_token("meta-llama/Llama-3.1-8B")
    assert "/" not in hub and hub != model_token("meta-llama_Llama-3.1-8B")
    with pytest.raises(ValueError, match="unknown tier"):
        names.request_topic("tiny", "urgent")  # type: ignore[arg-type]


def test_checked_in_json_schemas_are_current(tmp_path: Path) -> None:
    rendered = render_schemas()
    on_disk = {p.name: p.read_text() for p in JSON_DIR.glob("*.json")}
    assert on_disk == rendered, "schemas/json is stale: run `sluicegate schemas export schemas/json`"
    written = export_schemas(tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(rendered)


def test_exported_schema_rejects_what_pydantic_rejects() -> None:
    schema = json.loads((JSON_DIR / "InferenceRequest.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) >= {"request_id", "model"}
