"""Principals and ACLs on the ACL-enforcing SASL_SSL broker (``acl_kafka`` in ``tests/secure_kafka.py``): SCRAM
users made as ``admin`` and the ACLs that ``sluicegate kafka acls --json`` prints applied as they are, both through
confluent-kafka's admin client (aiokafka has no ACL or SCRAM calls)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)
from secure_kafka import SecureKafka

from sluicegate.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
_RESOURCE = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP, "cluster": ResourceType.BROKER}
_PATTERN = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}


def _client_config(kafka: SecureKafka, user: str, password: str) -> dict[str, str]:
    return {
        "bootstrap.servers": kafka.bootstrap,
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": user,
        "sasl.password": password,
        "ssl.ca.location": str(kafka.cafile),
    }


def admin_client(kafka: SecureKafka) -> AdminClient:
    """confluent-kafka's admin client, as the broker's super user."""
    return AdminClient(_client_config(kafka, "admin", kafka.password("admin")))


def read_refused(kafka: SecureKafka, user: str, password_file: Path, topic: str, group: str) -> bool:
    """Whether the broker refuses ``user`` the records of ``topic`` (TopicAuthorizationFailed), read from its start
    in ``group``; False once a record arrives. Through librdkafka, which reports a refused subscription (aiokafka
    keeps waiting for metadata it may not see, saying nothing)."""
    config = _client_config(kafka, user, password_file.read_text().strip())
    consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is None:
                return False
            if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                return True
            if not error.retriable():
                raise AssertionError(f"{user} reading {topic}: {error}")
        raise AssertionError(f"{user} read nothing from {topic} and was not refused within 30s")
    finally:
        consumer.close()


async def _all(futures: dict[Any, Future]) -> None:
    """Wait for every one of an admin call's futures; the first failure raises."""
    await asyncio.gather(*(asyncio.wrap_future(f) for f in futures.values()))


async def add_users(admin: AdminClient, users: list[str], folder: Path) -> dict[str, Path]:
    """SCRAM-SHA-512 users with random passwords; each one's password file (as a service reads it)."""
    files: dict[str, Path] = {}
    upserts = []
    for user in users:
        password = secrets.token_hex(12)
        files[user] = folder / f"{user}.password"
        files[user].write_text(password + "\n")
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
        upserts.append(UserScramCredentialUpsertion(user, info, password.encode()))
    await _all(admin.alter_user_scram_credentials(upserts))
    return files


def printed_acls(prefix: str, models: list[str], tenants: list[str]) -> list[dict[str, str]]:
    """What ``sluicegate kafka acls --tenant-topics --json`` prints for this deployment (the real command)."""
    command = [
        sys.executable,
        "-m",
        "cli",
        "kafka",
        "acls",
        "--tenant-topics",
        "--json",
        "--tenants",
        ",".join(tenants),
    ]
    for model in models:
        command += ["--model", model]
    env = {**os.environ, "SLUICEGATE_TOPIC_PREFIX": prefix}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def apply_acls(admin: AdminClient, acls: list[dict[str, str]]) -> int:
    """Create each printed ACL as an allow rule from any host; how many were created."""
    bindings = [
        AclBinding(
            _RESOURCE[acl["resource_type"]],
            acl["resource"],
            _PATTERN[acl["pattern_type"]],
            f"User:{acl['principal']}",
            "*",
            AclOperation[acl["operation"].upper()],
            AclPermissionType.ALLOW,
        )
        for acl in acls
    ]
    await _all(admin.create_acls(bindings))
    return len(bindings)


def as_user(settings: Settings, kafka: SecureKafka, user: str, password_file: Path) -> Settings:
    """``settings`` reaching the ACL broker as ``user``."""
    return settings.model_copy(
        update={
            "kafka_bootstrap": kafka.bootstrap,
            "kafka_security_protocol": "SASL_SSL",
            "kafka_sasl_mechanism": "SCRAM-SHA-512",
            "kafka_sasl_username": user,
            "kafka_sasl_password_file": password_file,
            "kafka_ssl_cafile": kafka.cafile,
        }
    )
