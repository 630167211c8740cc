"""The router's inbound topics and whose a record is: the record's own tenant on the shared topic, the topic's
tenant with tenants apart (a record naming another is refused)."""

from __future__ import annotations

import json

import pytest

from router.tenant_inbound import TenantInbound
from schemas import InferenceRequest, Names
from sluicegate.record_check import Rejection, validate_record
from sluicegate.settings import BackboneSettings

APART = Names("p.", tenants_apart=True)


def _request(**fields: str) -> InferenceRequest:
    request = validate_record(json.dumps({"request_id": "r-1", "model": "m", "prompt": "hi", **fields}).encode())
    assert isinstance(request, InferenceRequest)
    return request


def test_the_shared_topic_trusts_the_records_tenant() -> None:
    inbound = TenantInbound(Names("p."))
    assert inbound.topics == ["p.llm.inbound"]
    assert inbound.topics_to_create == ["p.llm.inbound", "p.llm.dlq"]
    assert inbound.claim(_request(tenant="b"), "p.llm.inbound").tenant == "b"
    assert inbound.dlq_topic("p.llm.inbound") == "p.llm.dlq"


def test_each_tenant_has_its_topic_and_dlq() -> None:
    inbound = TenantInbound(APART, ("a", "b:x"))
    b_topic = APART.tenant_inbound_topic("b:x")
    assert inbound.topics == ["p.llm.inbound.a", b_topic]
    assert ":" not in b_topic
    assert inbound.topics_to_create == [*inbound.topics, "p.llm.dlq.a", APART.dlq_topic_of("b:x")]
    assert inbound.tenant_of(b_topic) == "b:x"  # the list maps the hashed token back to the name
    assert inbound.dlq_topic("p.llm.inbound.a") == "p.llm.dlq.a"


def test_the_topic_gives_the_tenant_and_another_named_one_is_refused() -> None:
    inbound = TenantInbound(APART, ("a", "b"))
    assert inbound.claim(_request(), "p.llm.inbound.a").tenant == "a"  # named none: the topic's
    assert inbound.claim(_request(tenant="a"), "p.llm.inbound.a").tenant == "a"
    refused = inbound.claim(_request(tenant="b"), "p.llm.inbound.a")
    assert isinstance(refused, Rejection)
    assert (refused.reason, refused.request_id, refused.tenant) == ("tenant_mismatch", "r-1", "a")
    assert "'b'" in refused.detail and "p.llm.inbound.a" in refused.detail
    # "default" named outright is a tenant named, not a tenant left out.
    assert isinstance(inbound.claim(_request(tenant="default"), "p.llm.inbound.a"), Rejection)


def test_tenants_apart_without_a_tenant_list_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="SLUICEGATE_TENANTS"):
        TenantInbound.from_settings(BackboneSettings(tenant_topics=True))
    assert TenantInbound.from_settings(BackboneSettings(tenants="a")).topics == ["llm.inbound"]
