"""Which inbound topics the router reads, and whose a record on each is.

Shared (the default): ``llm.inbound``, and a record's own ``tenant`` is trusted: whoever may write the topic may
name any tenant. With tenants apart (``SLUICEGATE_TENANT_TOPICS``): one ``llm.inbound.<tenant>`` per configured
tenant, and the tenant is the topic's, which the broker's ACLs tie to the tenant's principal. A record that names
no tenant is served as the topic's; one that names another is refused (``tenant_mismatch``), not rewritten: a
producer that names a tenant believes it is writing as that tenant, and serving it quietly under another would
charge and answer the wrong one.

The topics come from the configured list (``SLUICEGATE_TENANTS``), not a pattern subscription: a tenant with
``:`` or ``@`` in its name has a hashed token in its topic name that only the list maps back to the name; the
same list gives the ACLs (``sluicegate kafka acls``) and the topics the router creates; and a topic someone else
created under the prefix is never read.
"""

from __future__ import annotations

from schemas import InferenceRequest, Names
from sluicegate.record_check import Rejection
from sluicegate.settings import BackboneSettings


class TenantInbound:
    """The inbound topics, and the tenant each one stands for (none for the shared topic)."""

    def __init__(self, names: Names, tenants: tuple[str, ...] = ()) -> None:
        self._names = names
        if not names.tenants_apart:
            self._tenant_of: dict[str, str | None] = {names.inbound_topic: None}
            return
        if not tenants:
            raise ValueError("tenant topics need the tenants to read (SLUICEGATE_TENANTS=a,b,...)")
        self._tenant_of = {names.tenant_inbound_topic(tenant): tenant for tenant in tenants}

    @classmethod
    def from_settings(cls, settings: BackboneSettings) -> TenantInbound:
        return cls(settings.names, settings.tenant_names if settings.tenant_topics else ())

    @property
    def topics(self) -> list[str]:
        """The topics to consume."""
        return list(self._tenant_of)

    @property
    def topics_to_create(self) -> list[str]:
        """The inbound topics and the DLQs their refused records go to."""
        return [*self._tenant_of, *dict.fromkeys(map(self.dlq_topic, self._tenant_of))]

    def tenant_of(self, topic: str) -> str | None:
        """The tenant a record on ``topic`` belongs to; None on the shared topic (the record says)."""
        return self._tenant_of.get(topic)

    def dlq_topic(self, topic: str) -> str:
        """Where a record refused on ``topic`` goes: its tenant's DLQ, or the shared one."""
        return self._names.dlq_topic_of(self.tenant_of(topic))

    def claim(self, request: InferenceRequest, topic: str) -> InferenceRequest | Rejection:
        """The request as its topic's tenant's, or why not: the record named another tenant."""
        tenant = self.tenant_of(topic)
        if tenant is None or request.tenant == tenant:
            return request
        if "tenant" not in request.model_fields_set:
            return request.model_copy(update={"tenant": tenant})
        detail = f"the record names tenant {request.tenant!r} but came on {topic!r}, tenant {tenant!r}'s topic"
        return Rejection("tenant_mismatch", detail, request.request_id, tenant=tenant)
