"""Kafka security settings: what goes together and what does not (one clear error each), the aiokafka options
they become, the OAUTHBEARER token re-read from its file, and secrets that never show in a repr or an error."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError

from sluicegate.kafka_security import FileTokenProvider, client_security
from sluicegate.settings import KafkaSecuritySettings, KafkaSettings

SECRET = "s3cr3t-never-shown"


def settings(**fields: object) -> KafkaSecuritySettings:
    return KafkaSecuritySettings(**fields)  # type: ignore[arg-type]


def scram(**more: object) -> dict[str, object]:
    return {
        "kafka_security_protocol": "SASL_SSL",
        "kafka_sasl_mechanism": "SCRAM-SHA-512",
        "kafka_sasl_username": "svc",
        **more,
    }


def test_the_default_is_plaintext_with_no_extra_options() -> None:
    assert client_security(settings()) == {"security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "SASL_SSL needs kafka_sasl_mechanism"),
        ({"kafka_sasl_mechanism": "PLAIN"}, "kafka_sasl_mechanism set but kafka_security_protocol is PLAINTEXT"),
        ({"kafka_sasl_username": "u", "kafka_security_protocol": "SSL"}, "kafka_sasl_username set but"),
        (scram(kafka_sasl_username=None, kafka_sasl_password=SECRET), "SCRAM-SHA-512 needs kafka_sasl_username"),
        (scram(), "needs kafka_sasl_password or kafka_sasl_password_file"),
        (
            {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "OAUTHBEARER"},
            "OAUTHBEARER needs kafka_sasl_oauth_token_file",
        ),
        ({"kafka_ssl_check_hostname": False, "kafka_ssl_key_password": SECRET}, "TLS files need SSL or SASL_SSL"),
        ({"kafka_security_protocol": "PLAIN"}, "kafka_security_protocol"),
    ],
)
def test_settings_that_do_not_go_together_are_refused_with_a_clear_error(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        settings(**fields)
    assert message in str(caught.value)
    assert SECRET not in str(caught.value)


def test_files_are_checked_and_tls_files_need_their_partner(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="kafka_ssl_cafile"):
        settings(kafka_security_protocol="SSL", kafka_ssl_cafile=tmp_path / "missing.pem")
    key = tmp_path / "client.key"
    key.write_text("not read until a client is made")
    with pytest.raises(ValidationError, match="kafka_ssl_keyfile needs kafka_ssl_certfile"):
        settings(kafka_security_protocol="SSL", kafka_ssl_keyfile=key)
    password = tmp_path / "pw"
    password.write_text(SECRET)
    with pytest.raises(ValidationError, match="not both"):
        settings(**scram(kafka_sasl_password=SECRET, kafka_sasl_password_file=password))


def test_scram_options_read_the_password_file_each_time_a_client_is_made(tmp_path: Path) -> None:
    password = tmp_path / "pw"
    password.write_text(SECRET + "\n")
    configured = settings(**scram(kafka_sasl_password_file=password, kafka_ssl_check_hostname=False))
    options = client_security(configured)
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (options["sasl_plain_username"], options["sasl_plain_password"]) == ("svc", SECRET)
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and not context.check_hostname
    password.write_text("rotated\n")
    assert client_security(configured)["sasl_plain_password"] == "rotated"
    password.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        client_security(configured)


def test_secrets_are_absent_from_repr_and_from_the_environment_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("SLUICEGATE_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("SLUICEGATE_KAFKA_SASL_USERNAME", "svc")
    monkeypatch.setenv("SLUICEGATE_KAFKA_SASL_PASSWORD", SECRET)
    read = KafkaSettings()
    assert read.kafka_sasl_secret() == SECRET
    for shown in (repr(read), str(read), read.model_dump_json(), repr(read.model_dump())):
        assert SECRET not in shown


def test_the_oauth_token_is_read_again_at_each_request(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    configured = settings(
        kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="OAUTHBEARER", kafka_sasl_oauth_token_file=token
    )
    provider = client_security(configured)["sasl_oauth_token_provider"]
    assert isinstance(provider, FileTokenProvider)
    assert asyncio.run(provider.token()) == "first"
    token.write_text("rotated")
    assert asyncio.run(provider.token()) == "rotated"
    token.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        asyncio.run(provider.token())
    with pytest.raises(ValidationError, match="unset kafka_sasl_username"):
        settings(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="OAUTHBEARER",
            kafka_sasl_oauth_token_file=token,
            kafka_sasl_username="svc",
        )
