"""Kafka over SASL_SSL with SCRAM-SHA-512 on a real broker (``tests/secure_kafka.py``): the project's producer,
consumer, admin client and topic creation work through it, and each way of getting security wrong (a wrong
password, a CA that did not sign the broker, a plaintext client on the TLS port) ends at once in one line that
names the reason, with no secret in it or in the logs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from secure_kafka import SecureKafka

from sluicegate.kafka import (
    create_admin,
    create_consumer,
    create_producer,
    ensure_topics,
    start_client,
    wait_for_kafka,
)
from sluicegate.kafka_security import KafkaAccessError
from sluicegate.settings import KafkaSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def capture_all_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Capture DEBUG from every logger, aiokafka's included: ``configure_logging`` (run by any in-process service an
    earlier test in this worker started) leaves aiokafka at WARNING, which would hide both the line this test looks
    for and any secret it must not find."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="aiokafka")


@pytest.fixture
def wrong_password_file(tmp_path: Path) -> Path:
    path = tmp_path / "wrong.password"
    path.write_text("not-the-password\n")
    return path


@pytest.fixture
def foreign_ca(tmp_path: Path) -> Path:
    """A CA that signed nothing the broker holds."""
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
            *("-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.pem"), "-days", "1", "-subj", "/CN=x"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return tmp_path / "ca.pem"


async def test_produce_consume_and_create_topics_over_sasl_ssl(
    secure_kafka: SecureKafka, caplog: pytest.LogCaptureFixture
) -> None:
    capture_all_logs(caplog)
    settings = secure_kafka.settings()
    cluster = await wait_for_kafka(secure_kafka.bootstrap, 30, settings=settings)
    assert cluster["brokers"]
    topic = f"sec.{uuid.uuid4().hex[:8]}"
    assert await ensure_topics(secure_kafka.bootstrap, {topic: 2}, 1, settings=settings) == {topic: 2}

    admin = create_admin(settings)
    producer = create_producer(settings)
    consumer = create_consumer(topic, group_id=f"sec-{uuid.uuid4().hex[:6]}", settings=settings)
    await start_client(admin, settings)
    try:
        assert topic in await admin.list_topics()
        await start_client(producer, settings)
        await start_client(consumer, settings)
        sent = {f"k{i}".encode(): f"v{i}".encode() for i in range(4)}
        for key, value in sent.items():
            await producer.send_and_wait(topic, value, key=key)
        got: dict[bytes, bytes] = {}
        deadline = time.monotonic() + 30
        while len(got) < len(sent) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                got |= {r.key: r.value for r in records}
        assert got == sent
        await consumer.commit()
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.delete_topics([topic])
        await admin.close()
    assert "Authenticated as sluicegate via SCRAM-SHA-512" in caplog.text
    assert secure_kafka.password() not in caplog.text


async def test_a_wrong_password_is_named_at_once(
    secure_kafka: SecureKafka, wrong_password_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    capture_all_logs(caplog)
    settings = secure_kafka.settings(kafka_sasl_password_file=wrong_password_file)
    expected = f"Kafka at {secure_kafka.bootstrap} refused the SASL credentials for user 'sluicegate' (SCRAM-SHA-512)"
    started = time.monotonic()
    with pytest.raises(KafkaAccessError) as waited:
        await wait_for_kafka(secure_kafka.bootstrap, 30, settings=settings)
    assert str(waited.value) == expected
    assert time.monotonic() - started < 10  # not retried until the wait's end: a password does not fix itself
    producer = create_producer(settings)
    with pytest.raises(KafkaAccessError) as started_client:
        await start_client(producer, settings)
    await producer.stop()
    assert str(started_client.value) == expected
    with pytest.raises(KafkaAccessError, match="refused the SASL credentials"):
        await ensure_topics(secure_kafka.bootstrap, {"never.created": 1}, 1, settings=settings)
    assert "not-the-password" not in caplog.text and secure_kafka.password() not in caplog.text


async def test_an_unknown_ca_is_named(secure_kafka: SecureKafka, foreign_ca: Path) -> None:
    settings = secure_kafka.settings(kafka_ssl_cafile=foreign_ca)
    with pytest.raises(KafkaAccessError) as caught:
        await wait_for_kafka(secure_kafka.bootstrap, 30, settings=settings)
    message = str(caught.value)
    assert message.startswith(f"Kafka at {secure_kafka.bootstrap}: its TLS certificate is not trusted (")
    assert str(foreign_ca) in message and "\n" not in message


async def test_a_plaintext_client_on_the_tls_port_is_told_so(secure_kafka: SecureKafka) -> None:
    settings = KafkaSettings(kafka_bootstrap=secure_kafka.bootstrap, kafka_security_protocol="PLAINTEXT")
    expected = f"Kafka at {secure_kafka.bootstrap} expects TLS but kafka_security_protocol is PLAINTEXT"
    with pytest.raises(KafkaAccessError, match=f"^{expected}"):
        await wait_for_kafka(secure_kafka.bootstrap, 30, settings=settings)
    admin = create_admin(settings)
    with pytest.raises(KafkaAccessError, match=f"^{expected}"):
        await start_client(admin, settings)
    await admin.close()


async def test_a_tls_client_on_a_plaintext_port_is_told_so(secure_kafka: SecureKafka, kafka_bootstrap: str) -> None:
    settings = secure_kafka.settings(kafka_bootstrap=kafka_bootstrap)
    with pytest.raises(KafkaAccessError, match="answers without TLS but kafka_security_protocol is SASL_SSL"):
        await wait_for_kafka(kafka_bootstrap, 30, settings=settings)


def test_the_command_line_stops_with_the_one_line_reason(secure_kafka: SecureKafka, wrong_password_file: Path) -> None:
    env = {
        **os.environ,
        **secure_kafka.env(),
        "SLUICEGATE_KAFKA_SASL_PASSWORD_FILE": str(wrong_password_file),
        "SLUICEGATE_TOPIC_PREFIX": f"sec{uuid.uuid4().hex[:6]}.",
    }
    done = subprocess.run(
        [sys.executable, "-m", "cli", "dlq", "list"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert (
        f"sluicegate: error: Kafka at {secure_kafka.bootstrap} refused the SASL credentials for user 'sluicegate' "
        "(SCRAM-SHA-512)" in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert "not-the-password" not in done.stderr + done.stdout
