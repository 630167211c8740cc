"""Resolving a model name that is a LoRA adapter (``sluicegate.lora.resolve``): base model + adapter for a
visible adapter, untouched for anything else, and the 404/400 of an explicit ``adapter``."""

from __future__ import annotations

import pytest

from schemas import InferenceRequest, LoRAAdapter
from sluicegate.lora.resolve import AdapterMismatchError, Resolved, UnknownAdapterError, resolve_name, resolve_request

ADAPTERS = {
    "sql": LoRAAdapter(name="sql", base_model="tiny", path="/a/sql", lora_int_id=1),
    "acme-chat": LoRAAdapter(name="acme-chat", base_model="tiny", path="/a/c", lora_int_id=2, tenant="acme"),
}


def test_adapter_name_resolves_to_its_base() -> None:
    assert resolve_name(ADAPTERS, "sql", tenant="anyone") == Resolved("tiny", "sql")
    assert resolve_name(ADAPTERS, "acme-chat", tenant="acme") == Resolved("tiny", "acme-chat")


def test_other_names_and_other_tenants_private_adapters_are_left_alone() -> None:
    assert resolve_name(ADAPTERS, "tiny", tenant="acme") == Resolved("tiny")
    assert resolve_name(ADAPTERS, "nope", tenant="acme") == Resolved("nope")
    # Another tenant's private adapter is just an unknown name: it meets the ordinary model 404 downstream.
    assert resolve_name(ADAPTERS, "acme-chat", tenant="other") == Resolved("acme-chat")


def test_explicit_adapter_is_checked() -> None:
    assert resolve_name(ADAPTERS, "tiny", tenant="t", adapter="sql") == Resolved("tiny", "sql")
    assert resolve_name(ADAPTERS, "sql", tenant="t", adapter="sql") == Resolved("tiny", "sql")
    with pytest.raises(UnknownAdapterError) as unknown:
        resolve_name(ADAPTERS, "tiny", tenant="t", adapter="ghost")
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
    assert unknown.value.body()["error"]["message"] == "The model 'ghost' does not exist or has no live worker."
    with pytest.raises(UnknownAdapterError):
        resolve_name(ADAPTERS, "tiny", tenant="other", adapter="acme-chat")
    with pytest.raises(AdapterMismatchError, match="applies to model 'tiny', not 'big'") as mismatch:
        resolve_name(ADAPTERS, "big", tenant="t", adapter="sql")
    assert mismatch.value.status == 400 and mismatch.value.param == "adapter"


def test_resolve_request_rewrites_model_and_adapter_only_when_needed() -> None:
    plain = InferenceRequest(request_id="r", model="tiny", prompt="hi")
    assert resolve_request(ADAPTERS, plain) is plain
    named = resolve_request(ADAPTERS, InferenceRequest(request_id="r", model="sql", prompt="hi"))
    assert (named.model, named.adapter, named.prompt) == ("tiny", "sql", "hi")
    explicit = InferenceRequest(request_id="r", model="tiny", prompt="hi", adapter="sql")
    assert resolve_request(ADAPTERS, explicit) is explicit
