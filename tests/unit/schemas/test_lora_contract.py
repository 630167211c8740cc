"""The LoRA contracts: the adapter record, and the adapter fields on requests, heartbeats and usage."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from schemas import InferenceRequest, LoRAAdapter, Names, UsageRecord, WorkerHeartbeat
from schemas.export import JSON_DIR


def _adapter(**patch: object) -> dict:
    return {"name": "sql-lora", "base_model": "tiny", "path": "s3://bucket/sql", "lora_int_id": 1, **patch}


def test_adapter_round_trips_and_defaults_to_public() -> None:
    adapter = LoRAAdapter.model_validate_json(json.dumps(_adapter(rank=8)))
    assert adapter.tenant is None and adapter.rank == 8
    assert adapter.created_at.tzinfo is not None
    assert LoRAAdapter.model_validate_json(adapter.model_dump_json()) == adapter
    assert adapter.visible_to("acme") and adapter.visible_to("default")


def test_private_adapter_is_visible_to_its_tenant_only() -> None:
    adapter = LoRAAdapter.model_validate_json(json.dumps(_adapter(tenant="acme")))
    assert adapter.visible_to("acme")
    assert not adapter.visible_to("other")


@pytest.mark.parametrize(
    ("patch", "bad_field"),
    [
        ({"lora_int_id": 0}, "lora_int_id"),
        ({"lora_int_id": "1"}, "lora_int_id"),  # strict: no coercion from strings
        ({"name": ""}, "name"),
        ({"name": "has space"}, "name"),
        ({"base_model": ""}, "base_model"),
        ({"path": ""}, "path"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "a b"}, "tenant"),
        ({"rank": 0}, "rank"),
        ({"created_at": "2030-01-01T00:00:00"}, "created_at"),  # naive time is ambiguous
        ({"surprise": 1}, "surprise"),
    ],
)
def test_adapter_violations_name_the_field(patch: dict, bad_field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LoRAAdapter.model_validate_json(json.dumps(_adapter(**patch)))
    assert any(str(err["loc"][0]) == bad_field for err in info.value.errors()), info.value


def test_request_adapter_is_optional_and_validated() -> None:
    old = InferenceRequest.model_validate_json('{"request_id": "r", "model": "tiny", "prompt": "a"}')
    assert old.adapter is None
    req = InferenceRequest.model_validate_json(
        '{"request_id": "r", "model": "tiny", "prompt": "a", "adapter": "org/sql-lora"}'
    )
    assert req.adapter == "org/sql-lora" and req.model == "tiny"
    assert InferenceRequest.model_validate_json(req.model_dump_json()) == req
    with pytest.raises(ValidationError, match="adapter"):
        InferenceRequest.model_validate_json('{"request_id": "r", "model": "tiny", "prompt": "a", "adapter": ""}')


def test_heartbeat_lists_adapters_and_older_heartbeats_parse() -> None:
    base = {
        "worker_id": "w1",
        "model": "tiny",
        "running": 0,
        "waiting": 0,
        "free_kv_blocks": 1,
        "total_kv_blocks": 1,
        "prefix_cache_hit_rate": 0.0,
    }
    assert WorkerHeartbeat.model_validate_json(json.dumps(base)).adapters == []
    hb = WorkerHeartbeat.model_validate_json(json.dumps({**base, "adapters": ["a", "b"]}))
    assert hb.adapters == ["a", "b"]
    with pytest.raises(ValidationError):
        WorkerHeartbeat.model_validate_json(json.dumps({**base, "adapters": "a"}))


def test_usage_record_carries_the_adapter() -> None:
    now = datetime.now(UTC).isoformat()
    body = {
        "request_id": "r",
        "tenant": "t",
        "model": "tiny",
        "tier": "standard",
        "outcome": "finished",
        "prompt_tokens": 1,
        "output_tokens": 1,
        "total_tokens": 2,
        "created_at": now,
        "finished_at": now,
        "duration_s": 0.1,
        "producer": "w1",
    }
    assert UsageRecord.model_validate_json(json.dumps(body)).adapter is None
    assert UsageRecord.model_validate_json(json.dumps({**body, "adapter": "sql-lora"})).adapter == "sql-lora"


def test_lora_key_names_are_prefixed_and_model_safe() -> None:
    names = Names("t1.")
    assert names.lora_adapters_key == "t1.lora:adapters"
    assert names.lora_next_id_key == "t1.lora:next_id"
    assert names.lora_checks_key("tiny") == "t1.lora:checks:tiny"
    assert "/" not in names.lora_checks_key("org/model")
    assert names.lora_verdict_key("c1") == "t1.lora:verdict:c1"


def test_exported_adapter_schema_is_closed_and_requires_the_id() -> None:
    schema = json.loads((JSON_DIR / "LoRAAdapter.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"name", "base_model", "path", "lora_int_id"}
    request = json.loads((JSON_DIR / "InferenceRequest.json").read_text())
    assert "adapter" in request["properties"] and "adapter" not in request["required"]
