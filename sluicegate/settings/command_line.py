"""What only the command line reads: the local stack ``sluicegate dev up`` starts (under the state folder), and the
client tools (``sluicegate batch``, ``sluicegate bench``), which talk to ingress like any OpenAI SDK user."""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Literal

from pydantic import Field, IPvAnyAddress

from .base import SettingsBase
from .state_dir import StateDirSettings


class LocalStackSettings(StateDirSettings):
    """The local Kafka and Redis: ports and brokers."""

    kafka_port: int = Field(9092, description="Port of the local Kafka broker (controller uses port + 1).")
    kafka_host: IPvAnyAddress = Field(
        IPv4Address("127.0.0.1"),
        description="Address the local Kafka's client listener binds and advertises (its controllers stay on "
        "127.0.0.1): another address of this machine lets processes in other network namespaces reach it.",
    )
    redis_port: int = Field(6379, description="Port of the local Redis server.")
    redis_tls: bool = Field(
        False,
        description="Start the local Redis with TLS only (redis_port is its tls-port; certificates made under the "
        "state folder) and with each service's ACL user (`sluicegate redis acls`; passwords in acl-passwords.json "
        "beside it); its URL is then rediss:// with the CA.",
    )
    kafka_brokers: int = Field(
        1,
        ge=1,
        le=5,
        description="Brokers of the local Kafka (`sluicegate dev up --brokers N`): node i listens on kafka_port + 2i "
        "(controller + 1); from 3 brokers topics get 3 replicas and min.insync.replicas 2.",
    )
    kafka_local_security: Literal["plaintext", "sasl_ssl"] = Field(
        "plaintext",
        description="Client listener of the local Kafka (`sluicegate dev up --kafka-security`): plaintext, or "
        "sasl_ssl with SCRAM-SHA-512 users and a CA made at start (paths and variables in "
        "<state_dir>/kafka-<port>/security/kafka.env).",
    )
    kafka_local_deny_without_acl: bool = Field(
        False,
        description="With kafka_local_security=sasl_ssl, deny every principal what no ACL allows "
        "(allow.everyone.if.no.acl.found=false), as a shared cluster should; by default a user with no ACL may do "
        "anything. Only admin, the super user, then does anything until ACLs are added (`sluicegate kafka acls`).",
    )
    kafka_full_jit: bool = Field(
        False,
        description="Let the local broker's JVM compile hot code with C2, as a production broker does, instead of "
        "C1 only: slower to start and busy compiling at first, then faster per request.",
    )


class ClientSettings(SettingsBase):
    """Where the client tools send requests, and with which key."""

    api_base_url: str = Field(
        "",
        description="OpenAI base URL `sluicegate batch` talks to; empty means the local ingress "
        "(http://127.0.0.1:<ingress_port>/v1).",
    )
    api_key: str = Field(
        "", description="API key `sluicegate batch` sends when neither --api-key nor OPENAI_API_KEY is given."
    )
