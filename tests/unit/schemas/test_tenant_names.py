"""Names with tenants apart: each tenant's own topics and keys, and the Redis patterns that keep one tenant's keys
from another's."""

from fnmatch import fnmatchcase

import pytest
from pydantic import ValidationError

from schemas import Names
from schemas.names import tenant_token
from sluicegate.settings import BackboneSettings


def test_shared_names_stay_the_default() -> None:
    names = Names("p.")
    assert names.results_topic_of("acme") == names.results_topic == "p.llm.results"
    assert names.dlq_topic_of("acme") == names.dlq_topic == "p.llm.dlq"
    assert names.control_topic_of("acme") == names.control_topic == "p.llm.control"
    assert names.stream_key("r1", "acme") == names.stream_key("r1") == "p.llm:stream:r1"
    assert names.request_key("r1", "acme") == "p.llm:request:r1"
    assert names.cancel_key("r1", "acme") == "p.llm:cancel:r1"
    with pytest.raises(ValueError, match="tenants apart"):
        names.tenant_key_patterns("acme")


def test_tenants_apart_give_each_tenant_its_topics_and_keys() -> None:
    names = Names("p.", tenants_apart=True)
    assert names.tenant_inbound_topic("acme") == "p.llm.inbound.acme"
    assert names.results_topic_of("acme") == "p.llm.results.acme"
    assert names.dlq_topic_of("acme") == "p.llm.dlq.acme"
    assert names.dlq_topic_of(None) == "p.llm.dlq"  # an unreadable record has no tenant to tell
    assert names.control_topic_of("acme") == "p.llm.control.acme"
    assert names.stream_key("r1", "acme") == "p.llm:stream:acme:r1"
    assert names.request_key("r1", "acme") == "p.llm:request:acme:r1"
    assert names.cancel_key("r1", "acme") == "p.llm:cancel:acme:r1"
    with pytest.raises(ValueError, match="needs the request's tenant"):
        names.stream_key("r1")


def test_a_tenants_key_patterns_match_its_keys_and_no_other_tenants() -> None:
    names = Names("p.", tenants_apart=True)
    patterns = names.tenant_key_patterns("a")
    own = [names.stream_key("r", "a"), names.request_key("r", "a"), names.cancel_key("r", "a")]
    assert all(any(fnmatchcase(key, p) for p in patterns) for key in own)
    # "a:b" and "a@x" look like "a" followed by more: their tokens hold no ":" so "a"'s patterns miss them.
    for other in ("a:b", "a@x", "ab", "b"):
        for key in (names.stream_key("r", other), names.request_key("r", other), names.cancel_key("r", other)):
            assert not any(fnmatchcase(key, p) for p in patterns), (other, key)


def test_tenant_tokens_are_topic_safe_and_distinct() -> None:
    assert tenant_token("acme") == "acme"
    assert tenant_token("a:b") != tenant_token("a@b") and ":" not in tenant_token("a:b")
    with pytest.raises(ValueError, match="not a tenant name"):
        tenant_token("a b")
    with pytest.raises(ValueError, match="not a tenant name"):
        tenant_token("")


def test_settings_name_the_tenants_and_the_mode() -> None:
    settings = BackboneSettings(topic_prefix="p.", tenant_topics=True, tenants=" a, b ,a")
    assert settings.tenant_names == ("a", "b")
    assert settings.names == Names("p.", tenants_apart=True)
    with pytest.raises(ValidationError, match="not a tenant name"):
        BackboneSettings(tenants="a,b c")
