"""The backbone every service stands on: Kafka and Redis, and the prefix that names a deployment's topics and keys
in both (so several deployments, or tests, share one Kafka and one Redis without meeting)."""

from __future__ import annotations

from pydantic import Field

from .kafka import KafkaSettings
from .redis import RedisSettings


class BackboneSettings(KafkaSettings, RedisSettings):
    """Kafka, Redis and the namespace in them; every service's settings include it."""

    topic_prefix: str = Field(
        "", description="Prefix for every Kafka topic and Redis key (isolates tests and deployments)."
    )
