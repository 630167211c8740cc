"""A SASL_SSL Kafka broker for the tests that check client security, shared by the whole session.

The local dev stack's broker (``cli.backbone.devstack``) with ``kafka_local_security=sasl_ssl``: a CA made with
openssl, SCRAM-SHA-512 users ``admin`` and ``sluicegate``. It runs on a port of its own
(``SLUICEGATE_TEST_SECURE_KAFKA_PORT``, default 19192; its controller takes the next one) under the repository's
``.sluicegate`` folder, beside the plaintext test broker, and is stopped at the end of the session when this
session started it. ``acl_kafka`` is another such broker that denies what no ACL allows
(``kafka_local_deny_without_acl``; port ``SLUICEGATE_TEST_ACL_KAFKA_PORT``, default 19196), for the tests that
apply ACLs. This module is a pytest plugin (``tests/conftest.py`` loads it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from needs import require_tool

from sluicegate.settings import KafkaSettings, Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
SECURE_KAFKA_PORT = int(os.environ.get("SLUICEGATE_TEST_SECURE_KAFKA_PORT", "19192"))
ACL_KAFKA_PORT = int(os.environ.get("SLUICEGATE_TEST_ACL_KAFKA_PORT", "19196"))


@dataclass(frozen=True)
class SecureKafka:
    """Where the SASL_SSL broker listens and the files that reach it."""

    bootstrap: str
    cafile: Path
    password_files: dict[str, Path]

    def password(self, user: str = "sluicegate") -> str:
        return self.password_files[user].read_text().strip()

    def env(self, user: str = "sluicegate") -> dict[str, str]:
        """The SLUICEGATE_KAFKA_* variables of a service that connects as ``user``."""
        return {
            "SLUICEGATE_KAFKA_BOOTSTRAP": self.bootstrap,
            "SLUICEGATE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "SLUICEGATE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "SLUICEGATE_KAFKA_SASL_USERNAME": user,
            "SLUICEGATE_KAFKA_SASL_PASSWORD_FILE": str(self.password_files[user]),
            "SLUICEGATE_KAFKA_SSL_CAFILE": str(self.cafile),
        }

    def settings(self, **changes: object) -> KafkaSettings:
        """Client settings as the service user, with ``changes`` applied (a wrong password, another CA...)."""
        fields: dict[str, object] = {
            "kafka_bootstrap": self.bootstrap,
            "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_mechanism": "SCRAM-SHA-512",
            "kafka_sasl_username": "sluicegate",
            "kafka_sasl_password_file": self.password_files["sluicegate"],
            "kafka_ssl_cafile": self.cafile,
            **changes,
        }
        return KafkaSettings(**fields)  # type: ignore[arg-type]


def _secure_broker(port: int, **changes: object) -> Iterator[SecureKafka]:
    """A SASL_SSL broker on ``port`` (started unless running), stopped at the end when started here."""
    require_tool("openssl", "makes the SASL_SSL broker's certificates")
    require_tool("java", "runs the Kafka broker")
    from cli.backbone import devstack
    from cli.backbone.broker_security import ADMIN_USER, SERVICE_USER, BrokerSecurity
    from cli.stack.layout import StackLayout

    settings = Settings(
        state_dir=REPO_ROOT / ".sluicegate",
        kafka_port=port,
        redis_port=port + 2,  # unused (Kafka only), but must differ from the broker's ports
        kafka_local_security="sasl_ssl",
        **changes,  # type: ignore[arg-type]
    )
    info = devstack.up(settings, services=("kafka",))
    security = BrokerSecurity.of(StackLayout.of(settings))
    try:
        yield SecureKafka(
            info.kafka_bootstrap,
            security.cafile,
            {user: security.password_file(user) for user in (ADMIN_USER, SERVICE_USER)},
        )
    finally:
        if info.started:
            devstack.down(settings, services=("kafka",))


@pytest.fixture(scope="session")
def secure_kafka() -> Iterator[SecureKafka]:
    """The session's SASL_SSL broker (started on first use)."""
    yield from _secure_broker(SECURE_KAFKA_PORT)


@pytest.fixture(scope="session")
def acl_kafka() -> Iterator[SecureKafka]:
    """A SASL_SSL broker that denies every principal but ``admin`` what no ACL allows (started on first use)."""
    yield from _secure_broker(ACL_KAFKA_PORT, kafka_local_deny_without_acl=True)
