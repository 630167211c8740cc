"""Kafka: how every service reaches the brokers (their security is its own concern, inherited), and the shape and
patience of the topics it creates."""

from __future__ import annotations

from pydantic import Field

from .kafka_security import KafkaSecuritySettings


class KafkaSettings(KafkaSecuritySettings):
    """The Kafka cluster and the topics Sluicegate creates on it."""

    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated.")
    topic_partitions: int = Field(6, ge=1, description="Partitions per request topic created.")
    topic_replication: int = Field(1, ge=1, description="Replication factor for topics Sluicegate creates.")
    topic_replication_auto: bool = Field(
        True,
        description="Raise the replication of topics Sluicegate creates to min(3, brokers in the cluster), with "
        "min.insync.replicas 2 at 3 replicas, so one broker may fail without losing or refusing a write.",
    )
    kafka_timeout_s: float = Field(
        5.0, gt=0, description="Longest ingress waits for Kafka (publish ack, topic creation) before a 503."
    )
