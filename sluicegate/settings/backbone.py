"""The backbone every service stands on: Kafka and Redis, and the namespace that names a deployment's topics and
keys in both: a prefix (so several deployments, or tests, share one Kafka and one Redis without meeting), and
whether tenants are kept apart in them (each tenant its own topics and keys, for brokers that bind tenants to
principals)."""

from __future__ import annotations

from pydantic import Field, field_validator

from schemas.names import Names, tenant_token

from .base import comma_separated
from .kafka import KafkaSettings
from .redis import RedisSettings


class BackboneSettings(KafkaSettings, RedisSettings):
    """Kafka, Redis and the namespace in them; every service's settings include it."""

    topic_prefix: str = Field(
        "", description="Prefix for every Kafka topic and Redis key (isolates tests and deployments)."
    )
    tenant_topics: bool = Field(
        False,
        description="Keep tenants apart on the broker: each tenant has its own inbound, results, DLQ and control "
        "topic (llm.inbound.<tenant>...), the router takes a record's tenant from its topic, and stream, request "
        "and cancel keys carry the tenant (llm:stream:<tenant>:<id>), so Kafka and Redis ACLs can bind a tenant "
        "to its own. Off: the shared topics, and a Kafka-native record's own tenant is trusted.",
    )
    tenants: str = Field(
        "",
        description="Comma-separated tenants with topics of their own under tenant_topics: the router consumes "
        "their inbound topics, workers their control topics, and `sluicegate kafka acls` prints their ACLs.",
    )

    @field_validator("tenants")
    @classmethod
    def _tenants_distinct(cls, value: str) -> str:
        tokens: dict[str, str] = {}
        for tenant in comma_separated(value):
            token = tenant_token(tenant)  # refuses a name no request could carry
            if token in tokens and tokens[token] != tenant:
                raise ValueError(f"tenants {tokens[token]!r} and {tenant!r} would share topics ({token!r})")
            tokens[token] = tenant
        return value

    @property
    def tenant_names(self) -> tuple[str, ...]:
        """``tenants`` as names, in order, each once."""
        return tuple(dict.fromkeys(comma_separated(self.tenants)))

    @property
    def names(self) -> Names:
        """The topic and key names of this deployment (prefix, and tenants apart or not)."""
        return Names(self.topic_prefix, tenants_apart=self.tenant_topics)
