"""Kafka security: how every Kafka client proves who it is and checks whom it talks to (TLS, SASL).

The fields map onto aiokafka's own options (``security_protocol``, ``sasl_mechanism``, ``ssl_context``...);
``sluicegate/kafka_security.py`` turns them into those options. Settings that contradict each other (a SASL
mechanism on a PLAINTEXT connection, a CA file without TLS, SCRAM without a user) stop the process at start with
one line naming both settings, rather than a client that connects without the security it was given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, FilePath, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from .base import SettingsBase

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]

#: Mechanisms that authenticate with a user name and password.
PASSWORD_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"})


class KafkaSecuritySettings(SettingsBase):
    """TLS and SASL for every Kafka client (producers, consumers, admin, readiness probe): the defaults are a
    plaintext connection, as the local stack serves by default."""

    # A validation error quotes the input, which here holds passwords; pydantic merges this into every class
    # composed with this one, so no service's settings error prints a secret.
    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_", extra="ignore", hide_input_in_errors=True)

    kafka_security_protocol: SecurityProtocol = Field(
        "PLAINTEXT", description="How clients connect: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL."
    )
    kafka_sasl_mechanism: SaslMechanism | None = Field(
        None, description="SASL mechanism, required with SASL_*: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER."
    )
    kafka_sasl_username: str | None = Field(None, description="SASL user name (PLAIN and SCRAM).")
    kafka_sasl_password: SecretStr | None = Field(
        None, description="SASL password (PLAIN and SCRAM); never logged. Or give kafka_sasl_password_file."
    )
    kafka_sasl_password_file: FilePath | None = Field(
        None, description="File holding the SASL password (trailing newline ignored), read when a client is made."
    )
    kafka_sasl_oauth_token_file: FilePath | None = Field(
        None,
        description="File holding the OAUTHBEARER token, read again at each token request so a rotated token "
        "(e.g. a projected service-account token) is picked up.",
    )
    kafka_ssl_cafile: FilePath | None = Field(
        None, description="PEM CA bundle that signs the brokers' certificates; unset means the system's CAs."
    )
    kafka_ssl_certfile: FilePath | None = Field(
        None, description="PEM client certificate for mutual TLS (with kafka_ssl_keyfile)."
    )
    kafka_ssl_keyfile: FilePath | None = Field(None, description="PEM private key of kafka_ssl_certfile.")
    kafka_ssl_key_password: SecretStr | None = Field(
        None, description="Password of an encrypted kafka_ssl_keyfile; never logged."
    )
    kafka_ssl_check_hostname: bool = Field(
        True, description="Check that a broker's certificate names the host connected to."
    )

    @property
    def kafka_uses_tls(self) -> bool:
        return self.kafka_security_protocol in ("SSL", "SASL_SSL")

    @property
    def kafka_uses_sasl(self) -> bool:
        return self.kafka_security_protocol.startswith("SASL_")

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecuritySettings:
        """One clear error for settings that do not go together."""
        protocol, mechanism = self.kafka_security_protocol, self.kafka_sasl_mechanism
        given = {
            "kafka_sasl_username": self.kafka_sasl_username,
            "kafka_sasl_password": self.kafka_sasl_password,
            "kafka_sasl_password_file": self.kafka_sasl_password_file,
            "kafka_sasl_oauth_token_file": self.kafka_sasl_oauth_token_file,
        }
        if not self.kafka_uses_sasl:
            stray = [name for name, value in {"kafka_sasl_mechanism": mechanism, **given}.items() if value]
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} set but kafka_security_protocol is {protocol}: use SASL_SSL (or "
                    "SASL_PLAINTEXT) to authenticate, or unset them"
                )
        elif mechanism is None:
            raise ValueError(f"kafka_security_protocol {protocol} needs kafka_sasl_mechanism ({_choices()})")
        elif mechanism in PASSWORD_MECHANISMS:
            self._check_password(mechanism)
        elif self.kafka_sasl_oauth_token_file is None:
            raise ValueError("kafka_sasl_mechanism OAUTHBEARER needs kafka_sasl_oauth_token_file")
        elif self.kafka_sasl_username or self.kafka_sasl_password or self.kafka_sasl_password_file:
            raise ValueError("OAUTHBEARER authenticates with a token: unset kafka_sasl_username and password")
        self._check_tls()
        return self

    def _check_password(self, mechanism: str) -> None:
        if not self.kafka_sasl_username:
            raise ValueError(f"kafka_sasl_mechanism {mechanism} needs kafka_sasl_username")
        if self.kafka_sasl_password is None and self.kafka_sasl_password_file is None:
            raise ValueError(f"kafka_sasl_mechanism {mechanism} needs kafka_sasl_password or kafka_sasl_password_file")
        if self.kafka_sasl_password is not None and self.kafka_sasl_password_file is not None:
            raise ValueError("give kafka_sasl_password or kafka_sasl_password_file, not both")
        if self.kafka_sasl_oauth_token_file is not None:
            raise ValueError(f"kafka_sasl_oauth_token_file is for OAUTHBEARER, not {mechanism}")

    def _check_tls(self) -> None:
        files = {
            "kafka_ssl_cafile": self.kafka_ssl_cafile,
            "kafka_ssl_certfile": self.kafka_ssl_certfile,
            "kafka_ssl_keyfile": self.kafka_ssl_keyfile,
            "kafka_ssl_key_password": self.kafka_ssl_key_password,
        }
        stray = [name for name, value in files.items() if value is not None]
        if stray and not self.kafka_uses_tls:
            raise ValueError(
                f"{', '.join(stray)} set but kafka_security_protocol is {self.kafka_security_protocol}: "
                "TLS files need SSL or SASL_SSL"
            )
        if self.kafka_ssl_keyfile is not None and self.kafka_ssl_certfile is None:
            raise ValueError("kafka_ssl_keyfile needs kafka_ssl_certfile (the client certificate it belongs to)")
        if self.kafka_ssl_key_password is not None and self.kafka_ssl_certfile is None:
            raise ValueError("kafka_ssl_key_password needs kafka_ssl_certfile and kafka_ssl_keyfile")

    def kafka_sasl_secret(self) -> str:
        """The SASL password: the setting, else the file's first line (read now, so a rotated file is used by
        the next client made)."""
        if self.kafka_sasl_password is not None:
            return self.kafka_sasl_password.get_secret_value()
        if self.kafka_sasl_password_file is None:
            raise ValueError("no kafka_sasl_password or kafka_sasl_password_file set")
        return _first_line(self.kafka_sasl_password_file, "kafka_sasl_password_file")


def _choices() -> str:
    return ", ".join(SaslMechanism.__args__)


def _first_line(path: Path, setting: str) -> str:
    """A secret file's content without its trailing newline; an empty file is an error naming the setting."""
    try:
        text = path.read_text().strip("\r\n")
    except OSError as exc:
        raise ValueError(f"{setting} {path} cannot be read: {exc.strerror}") from exc
    if not text:
        raise ValueError(f"{setting} {path} is empty")
    return text
