"""Kafka client security: the aiokafka options (TLS context, SASL credentials, OAUTHBEARER token provider) that
every client built by ``sluicegate/kafka.py`` gets from :class:`KafkaSecuritySettings`, and the one-line reason a
broker refused a client (wrong credentials, an unknown CA, a plaintext client on a TLS port).

Only ``sluicegate/kafka.py`` builds aiokafka clients (``tests/unit/test_kafka_clients_use_factories.py`` checks
it), so no client can connect without the security the settings ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context

from sluicegate.settings import KafkaSecuritySettings


class FileTokenProvider(AbstractTokenProvider):
    """OAUTHBEARER tokens read from a file at every request, so a token rotated on disk (a projected Kubernetes
    service-account token, a sidecar that refreshes it) is the one the next connection sends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def token(self) -> str:
        # A file read may block on a slow or network volume: off the event loop.
        text = await asyncio.to_thread(self.path.read_text)
        token = text.strip()
        if not token:
            raise ValueError(f"kafka_sasl_oauth_token_file {self.path} is empty")
        return token

    def __repr__(self) -> str:
        return f"FileTokenProvider({str(self.path)!r})"


def ssl_context(settings: KafkaSecuritySettings) -> ssl.SSLContext:
    """The TLS context of ``settings``: its CA (else the system's), its client certificate for mutual TLS, and
    hostname checking as set."""
    password = settings.kafka_ssl_key_password
    context = create_ssl_context(
        cafile=settings.kafka_ssl_cafile,
        certfile=settings.kafka_ssl_certfile,
        keyfile=settings.kafka_ssl_keyfile,
        password=password.get_secret_value() if password is not None else None,
    )
    context.check_hostname = settings.kafka_ssl_check_hostname
    return context


def client_security(settings: KafkaSecuritySettings) -> dict[str, Any]:
    """aiokafka's security options for one client (producer, consumer, admin or a bare connection)."""
    options: dict[str, Any] = {"security_protocol": settings.kafka_security_protocol}
    if settings.kafka_uses_tls:
        options["ssl_context"] = ssl_context(settings)
    if settings.kafka_uses_sasl:
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        if settings.kafka_sasl_oauth_token_file is not None:
            options["sasl_oauth_token_provider"] = FileTokenProvider(settings.kafka_sasl_oauth_token_file)
        else:
            options["sasl_plain_username"] = settings.kafka_sasl_username
            options["sasl_plain_password"] = settings.kafka_sasl_secret()
    return options


class KafkaAccessError(RuntimeError):
    """The broker answers but refuses this client (credentials, certificates, protocol): retrying will not help,
    so it is no ``ConnectionError`` (which readiness waits retry). The message is one line, printed as it is."""


def _who(settings: KafkaSecuritySettings) -> str:
    if settings.kafka_sasl_mechanism == "OAUTHBEARER":
        return f"the OAUTHBEARER token in {settings.kafka_sasl_oauth_token_file}"
    return f"user {settings.kafka_sasl_username!r} ({settings.kafka_sasl_mechanism})"


def explain_refusal(exc: BaseException, address: str, settings: KafkaSecuritySettings) -> KafkaAccessError | None:
    """The one-line reason a connection to ``address`` failed when it is one that retrying will not mend; None
    for failures that may pass (nothing listening yet, a broker still starting)."""
    protocol = settings.kafka_security_protocol
    if isinstance(exc, SaslAuthenticationFailed | AuthenticationFailedError | IllegalSaslStateError):
        return KafkaAccessError(f"Kafka at {address} refused the SASL credentials for {_who(settings)}")
    if isinstance(exc, UnsupportedSaslMechanismError):
        return KafkaAccessError(f"Kafka at {address} does not offer SASL {settings.kafka_sasl_mechanism}: {exc}")
    if isinstance(exc, ssl.SSLCertVerificationError):
        where = f"kafka_ssl_cafile {settings.kafka_ssl_cafile}" if settings.kafka_ssl_cafile else "the system's CAs"
        return KafkaAccessError(
            f"Kafka at {address}: its TLS certificate is not trusted ({exc.verify_message}); "
            f"check {where} and kafka_ssl_check_hostname"
        )
    if isinstance(exc, ssl.SSLError):
        return KafkaAccessError(
            f"Kafka at {address}: TLS handshake failed ({exc.reason or exc}); is it a TLS listener? "
            f"kafka_security_protocol is {protocol}"
        )
    return None


async def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake (its certificate unchecked: only the protocol matters)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), timeout_s)
    return True


async def _speaks_plaintext_kafka(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers a Kafka request sent without TLS."""
    try:
        conn = await asyncio.wait_for(create_conn(host, port, request_timeout_ms=int(timeout_s * 1000)), timeout_s)
    except (KafkaError, OSError, TimeoutError):
        return False
    conn.close()
    return True


async def _wrong_protocol(
    exc: BaseException, host: str, port: int, settings: KafkaSecuritySettings, timeout_s: float
) -> KafkaAccessError | None:
    """A listener of the other kind (TLS or not) fails the first exchange with no answer at all, which a broker
    that is merely down does too: a connection of the other kind tells them apart."""
    address, protocol = f"{host}:{port}", settings.kafka_security_protocol
    if isinstance(exc, ssl.SSLCertVerificationError | KafkaError) and not isinstance(exc, KafkaConnectionError):
        return None
    if not isinstance(exc, KafkaConnectionError | TimeoutError | ConnectionError | ssl.SSLError):
        return None
    if not settings.kafka_uses_tls and await _speaks_tls(host, port, timeout_s):
        # A TLS listener reads a plaintext request as a broken TLS record and drops the connection.
        return KafkaAccessError(
            f"Kafka at {address} expects TLS but kafka_security_protocol is {protocol}"
            " (set SSL or SASL_SSL, and kafka_ssl_cafile for a private CA)"
        )
    if settings.kafka_uses_tls and await _speaks_plaintext_kafka(host, port, timeout_s):
        return KafkaAccessError(
            f"Kafka at {address} answers without TLS but kafka_security_protocol is {protocol}"
            " (is this the broker's plaintext port?)"
        )
    return None


async def check_access(
    host: str, port: int, settings: KafkaSecuritySettings, timeout_s: float, client_id: str = "sluicegate-probe"
) -> None:
    """One connection to ``host:port`` with the settings' security: TLS handshake, API versions and SASL.

    aiokafka's clients log why a connection failed and raise only "Unable to bootstrap", so the readiness checks
    connect once themselves to learn the reason. Raises :class:`KafkaAccessError` when the broker refuses this
    client and ``ConnectionError`` when it did not answer.
    """
    address = f"{host}:{port}"
    try:
        conn = await asyncio.wait_for(
            create_conn(
                host, port, client_id=client_id, request_timeout_ms=int(timeout_s * 1000), **client_security(settings)
            ),
            timeout_s,
        )
    except (KafkaError, OSError, TimeoutError) as exc:
        refusal = await _wrong_protocol(exc, host, port, settings, timeout_s) or explain_refusal(exc, address, settings)
        if refusal is not None:
            raise refusal from exc
        raise ConnectionError(f"Kafka at {address} does not answer: {exc!r}") from exc
    conn.close()
