"""Batch lines naming a LoRA adapter resolve as online (``sluicegate.lora.resolve``): the request goes to the base
model with ``adapter`` set; another tenant's private adapter is an unknown model; the usage ledger's record and the
response cache's digest carry the adapter."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from batch_service.prepare import BuiltLine, build_line
from ingress.response_cache import request_digest
from schemas import InferenceRequest, LoRAAdapter, Usage, utcnow
from sluicegate.api.limits import Limits
from sluicegate.batches.store import LineOutcome
from sluicegate.lora.resolve import resolve_request
from sluicegate.usage.ledger import usage_record

ADAPTERS = {
    "sql": LoRAAdapter(name="sql", base_model="tiny", path="/a/sql", lora_int_id=1),
    "mine": LoRAAdapter(name="mine", base_model="tiny", path="/a/m", lora_int_id=2, tenant="acme"),
}


def _line(model: str, tenant: str, endpoint: str = "/v1/chat/completions") -> BuiltLine | LineOutcome:
    body: dict[str, Any] = (
        {"model": model, "input": "embed me"}
        if endpoint == "/v1/embeddings"
        else {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    )
    return build_line(
        body,
        endpoint=endpoint,
        request_id="batch_x-L1",
        tenant=tenant,
        limits=Limits(),
        deadline=utcnow() + timedelta(hours=1),
        known_models={"tiny"},
        route=lambda request: resolve_request(ADAPTERS, request),
    )


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/embeddings"])
def test_adapter_line_goes_to_its_base_model(endpoint: str) -> None:
    built = _line("sql", "anyone", endpoint)
    assert isinstance(built, BuiltLine), built
    assert (built.request.model, built.request.adapter) == ("tiny", "sql")
    own = _line("mine", "acme", endpoint)
    assert isinstance(own, BuiltLine) and own.request.adapter == "mine"


def test_private_adapter_of_another_tenant_is_an_unknown_model() -> None:
    refused = _line("mine", "other")
    assert isinstance(refused, LineOutcome)
    assert (refused.status_code, refused.code, refused.param) == (404, "model_not_found", "model")
    plain = _line("tiny", "other")
    assert isinstance(plain, BuiltLine) and plain.request.adapter is None


def test_usage_record_and_cache_digest_carry_the_adapter() -> None:
    base = InferenceRequest(request_id="r", model="tiny", prompt="hi", sampling={"temperature": 0.0})
    adapted = base.model_copy(update={"adapter": "sql"})
    usage = Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    assert usage_record(adapted, producer="w1", usage=usage, finish_reason="stop").adapter == "sql"
    assert usage_record(base, producer="w1", usage=usage, finish_reason="stop").adapter is None
    # The adapter changes the reply, so it changes the cache key.
    assert request_digest(adapted, shared=False) != request_digest(base, shared=False)
    assert request_digest(adapted, shared=True) != request_digest(base, shared=True)
